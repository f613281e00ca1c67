#!/usr/bin/env python
"""Perplexity and top-1 agreement of a model with float weights, int8 or int4 weights, an int8 or a float8 KV
cache (vLLM's fp8 = fp8_e4m3, and fp8_e5m2), and both.

    python scripts/quant_quality.py --model checkpoints/small [--dtype float32] [--windows 64 --window-len 512]
    python scripts/quant_quality.py --model SmolLM2-135M-Instruct --text /usr/lib/python3.11/textwrap.py \
        --window-len 1024 --batch-size 2

`--model` is anything the engine takes (`loading.model_source.resolve_model_path`): a model
directory, a GGUF file, a Hugging Face ID, or the default model's name. Every window is prefilled in
one chunk (or in `--prefill-chunk` chunks, as the engine splits a long prompt) through the paged KV
cache (`steps.model_step` with all logits, the int8 matmul the engine would pick on this platform),
so the int8 cache is exercised as in serving: each layer writes (quantizes) its K/V into the pages,
then attends over them. Tokens come from the corpus' held-out split (scripts/corpus.py), or from
`--text FILE` (no special tokens), cut into non-overlapping windows. The scores: the mean next-token
NLL, the top-1 accuracy (the argmax is the next token) and, for every variant but the first, the
top-1 agreement with the first (the same argmax next-token prediction at the same position,
teacher-forced), also where the first variant's top-2 logit margin is at least `--margin` (no
near-tie: a flip there is the variant's error, not a coin toss). An int8 KV cache's figures move
with float rounding (a value at a rounding boundary flips, and the change grows through the
layers): one chunk and 512-token chunks of the same window differ by about as much as int8 KV
differs from float (docs/BENCHMARKS.md). `mean_nll` and `score` are the reusable parts (any params,
tokens and cache dtype).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {  # name: (quantization, kv_cache_dtype); "w8a8": int8 weights and activations (per channel, per token)
    "float": ("none", "auto"),
    "int8 weights": ("int8", "auto"),
    "w8a8": ("int8", "auto"),
    "int4 weights": ("int4", "auto"),
    "int8 KV": ("none", "int8"),
    "both": ("int8", "int8"),
    "fp8 KV": ("none", "fp8"),  # float8 e4m3 pages, a scale per layer (1.0 unless the checkpoint gives them)
    "fp8_e5m2 KV": ("none", "fp8_e5m2"),
}


@functools.partial(jax.jit, static_argnames=("cfg", "matmul_backend"))
def _nll_sum(params, cache, batch, target, cfg, matmul_backend="reference"):
    """One prefill chunk of every window of the batch: the sum of next-token NLL (f32) over the
    positions whose `target` (i32[R, B, t], the next token; -1: none) is set, their count, the argmax
    next-token prediction at every position (i32[R, B, t]), the margin of its logit over the second
    best's (f32[R, B, t]) and the updated cache."""
    from jaxserve import steps

    options = steps.StepOptions(scan_layers=True, matmul_backend=matmul_backend)
    logits, cache = steps.model_step(params, cache, batch, cfg, options, all_logits=True)
    logp = jax.nn.log_softmax(logits, axis=-1)  # f32[R, B, t, V]
    nll = -jnp.take_along_axis(logp, jnp.maximum(target, 0)[..., None], axis=-1)[..., 0]
    scored = target >= 0
    top2 = jax.lax.top_k(logits, 2)[0]
    return (
        jnp.sum(jnp.where(scored, nll, 0.0)),
        jnp.sum(scored),
        jnp.argmax(logits, axis=-1).astype(jnp.int32),
        top2[..., 0] - top2[..., 1],
        cache,
    )


def score(
    params,
    cfg,
    windows: np.ndarray,
    dtype,
    kv_cache_dtype: str = "auto",
    batch_size: int = 8,
    page_size: int = 16,
    matmul_backend: str = "reference",
    chunk: int | None = None,
) -> tuple[float, np.ndarray, np.ndarray]:
    """Mean next-token NLL (nats) of `windows` i32[n, T], each prefilled from position 0 through a
    fresh paged cache of `kv_cache_dtype` (in one chunk, or in chunks of `chunk` tokens as the engine
    prefills a prompt longer than max_num_batched_tokens), the argmax next-token predictions
    i32[n, T-1] and their margins over the second-best logit f32[n, T-1]. A last batch of fewer than
    batch_size windows runs on its own (one more compile)."""
    from jaxserve.model.kv_cache import StepBatch, init_cache

    n, T = windows.shape
    pages = math.ceil(T / page_size)
    chunk = T if chunk is None else chunk
    total, count, argmax, margins = 0.0, 0, [], []
    for start in range(0, n, batch_size):
        rows = windows[start : start + batch_size].astype(np.int32)
        b = len(rows)
        targets = np.concatenate([rows[:, 1:], np.full((b, 1), -1, np.int32)], axis=1)
        cache = init_cache(cfg, b * pages + 1, page_size, dtype, kv_cache_dtype=kv_cache_dtype)
        page_table = np.arange(1, b * pages + 1, dtype=np.int32).reshape(1, b, pages)
        tops, gaps = [], []
        for lo in range(0, T, chunk):
            hi = min(lo + chunk, T)
            batch = StepBatch(
                tokens=rows[None, :, lo:hi],
                start_pos=np.full((1, b), lo, np.int32),
                num_new=np.full((1, b), hi - lo, np.int32),
                page_table=page_table,
            )
            s, c, top, gap, cache = _nll_sum(
                params, cache, batch, targets[None, :, lo:hi], cfg=cfg, matmul_backend=matmul_backend
            )
            total, count = total + float(s), count + int(c)
            tops.append(np.asarray(top)[0])
            gaps.append(np.asarray(gap)[0])
        argmax.append(np.concatenate(tops, axis=1)[:, :-1])
        margins.append(np.concatenate(gaps, axis=1)[:, :-1])
    return total / count, np.concatenate(argmax), np.concatenate(margins)


def mean_nll(
    params, cfg, windows: np.ndarray, dtype, kv_cache_dtype: str = "auto", batch_size: int = 8, page_size: int = 16
) -> float:
    """Mean next-token NLL (nats) of `windows` i32[n, T] (see `score`)."""
    return score(params, cfg, windows, dtype, kv_cache_dtype, batch_size, page_size)[0]


def heldout_windows(model_dir: str, num_windows: int, window_len: int) -> np.ndarray:
    from corpus import iter_texts
    from jaxserve.loading.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    ids: list[int] = []
    for _, text in iter_texts("heldout"):
        ids.extend(tok.encode(text, add_special_tokens=False))
        if len(ids) >= num_windows * window_len:
            break
    if len(ids) < num_windows * window_len:
        raise SystemExit(f"the held-out split has only {len(ids)} tokens; ask for fewer windows")
    return np.asarray(ids[: num_windows * window_len], np.int32).reshape(num_windows, window_len)


def text_windows(model_dir: str, path: str, num_windows: int | None, window_len: int) -> tuple[np.ndarray, int]:
    """The file's tokens (no special tokens) cut into `num_windows` windows (all that fit when None),
    and the file's token count."""
    from jaxserve.loading.tokenizer import load_tokenizer

    ids = load_tokenizer(model_dir).encode(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)
    n = len(ids) // window_len if num_windows is None else num_windows
    if n < 1 or len(ids) < n * window_len:
        raise SystemExit(f"{path} has {len(ids)} tokens: fewer than {max(n, 1)} windows of {window_len}")
    return np.asarray(ids[: n * window_len], np.int32).reshape(n, window_len), len(ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default="checkpoints/small",
        help="a model directory, a GGUF file, a Hugging Face ID, or SmolLM2-135M-Instruct (the default model)",
    )
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--text", help="score this file's tokens instead of the corpus' held-out split")
    ap.add_argument("--windows", type=int, help="how many windows (default: 64; with --text, all that fit)")
    ap.add_argument("--window-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        help="prefill each window in chunks of this many tokens (the engine's max_num_batched_tokens, "
        "512 by default); default: the whole window in one chunk",
    )
    ap.add_argument(
        "--margin",
        type=float,
        default=0.5,
        help="also report the top-1 agreement where the first variant's top-2 logit margin is at least "
        "this (no near-tie)",
    )
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated names of {', '.join(VARIANTS)}; NAME@gN sets quantization_group_size=N "
        "(int8: 0 = a scale per output channel), e.g. 'int8 weights@g32'",
    )
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)

    from jaxserve.config import EngineConfig
    from jaxserve.runner.backends import resolve_quantized_matmul
    from jaxserve.loading.model_source import resolve_model_path
    from jaxserve.loading.model_loader import load_model
    from jaxserve.model.sharding import make_mesh

    model_dir = resolve_model_path(args.model)
    file_tokens = None
    if args.text:
        windows, file_tokens = text_windows(model_dir, args.text, args.windows, args.window_len)
    else:
        windows = heldout_windows(model_dir, 64 if args.windows is None else args.windows, args.window_len)
    scored = windows.shape[0] * (windows.shape[1] - 1)
    print(
        f"model {args.model} ({model_dir}); {windows.shape[0]} windows of {windows.shape[1]} tokens"
        + (f" from {args.text} ({file_tokens} tokens)" if args.text else " (held-out split)")
        + f"; {scored} next-token predictions scored; prefilled in "
        + (f"chunks of {args.prefill_chunk} tokens" if args.prefill_chunk else "one chunk"),
        flush=True,
    )
    dtype = jnp.dtype(args.dtype)
    targets = windows[:, 1:]
    loaded: dict[str, object] = {}
    results, base_name, base_argmax, base_margin = {}, None, None, None
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        base_variant, _, group = name.partition("@g")
        quantization, kv = VARIANTS[base_variant]
        group_size = int(group) if group else (0 if base_variant == "w8a8" else None)
        activations = "int8" if base_variant == "w8a8" else "none"
        if (quantization, group_size) not in loaded:
            settings = EngineConfig(
                model=model_dir, dtype=args.dtype, quantization=quantization, quantization_group_size=group_size
            )
            loaded[quantization, group_size] = load_model(settings, make_mesh((1, 1)), stacked=True)
        model = loaded[quantization, group_size]
        matmul = resolve_quantized_matmul("auto", jax.default_backend(), (1, 1), quantization, activations)
        nll, argmax, margin = score(
            model.params,
            model.cfg,
            windows,
            dtype,
            kv,
            args.batch_size,
            matmul_backend=matmul,
            chunk=args.prefill_chunk,
        )
        results[name] = {"nll": nll, "perplexity": math.exp(nll), "top1_accuracy": float(np.mean(argmax == targets))}
        line = f"{name:14} perplexity {math.exp(nll):8.4f}  top-1 accuracy {100 * results[name]['top1_accuracy']:6.2f}%"
        if base_name is None:
            base_name, base_argmax, base_margin = name, argmax, margin
        else:
            agree = argmax == base_argmax
            clear = base_margin >= args.margin
            results[name]["top1_agreement"] = float(np.mean(agree))
            results[name]["top1_disagreements"] = int(np.sum(~agree))
            results[name]["top1_agreement_no_near_tie"] = float(np.mean(agree[clear]))
            results[name]["positions_no_near_tie"] = int(np.sum(clear))
            base = results[base_name]["perplexity"]
            line += (
                f"  ({100 * (math.exp(nll) / base - 1):+.2f}% perplexity vs {base_name}; top-1 agreement "
                f"{100 * np.mean(agree):.2f}%, {int(np.sum(~agree))} of {agree.size} positions differ; "
                f"{100 * np.mean(agree[clear]):.2f}% at the {int(np.sum(clear))} of margin >= {args.margin:g})"
            )
        print(line, flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "args": vars(args),
                    "model_dir": model_dir,
                    "file_tokens": file_tokens,
                    "tokens": int(windows.size),
                    "scored": scored,
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
