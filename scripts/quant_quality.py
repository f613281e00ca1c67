#!/usr/bin/env python
"""Perplexity of a model with float weights, int8 weights, an int8 KV cache, and both, on held-out text.

    python scripts/quant_quality.py --model checkpoints/small [--dtype float32] [--windows 64 --window-len 512]

Every window is prefilled in one chunk through the paged KV cache (`steps.model_step` with all
logits), so the int8 cache is exercised exactly as in serving: each layer writes (quantizes) its
K/V into the pages, then attends over them. Tokens come from the corpus' held-out split
(scripts/corpus.py), cut into non-overlapping windows; the score is the mean next-token NLL.
`mean_nll` is the reusable part (any params, tokens and cache dtype).
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

VARIANTS = {  # name: (quantization, kv_cache_dtype)
    "float": ("none", "auto"),
    "int8 weights": ("int8", "auto"),
    "int8 KV": ("none", "int8"),
    "both": ("int8", "int8"),
}


@functools.partial(jax.jit, static_argnames=("cfg",))
def _nll_sum(params, cache, batch, cfg):
    """Sum of next-token NLL over every window of the batch (f32), and the count of scored tokens."""
    from jaxserve import steps

    logits, _ = steps.model_step(params, cache, batch, cfg, steps.StepOptions(all_logits=True, scan_layers=True))
    logp = jax.nn.log_softmax(logits[..., :-1, :], axis=-1)  # f32[R, B, T-1, V]
    target = batch.tokens[..., 1:]
    nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    return jnp.sum(nll), nll.size


def mean_nll(params, cfg, windows: np.ndarray, dtype, kv_cache_dtype: str = "auto", batch_size: int = 8,
             page_size: int = 16) -> float:
    """Mean next-token NLL (nats) of `windows` i32[n, T] (n a multiple of batch_size), each prefilled
    from position 0 through a fresh paged cache of `kv_cache_dtype`."""
    from jaxserve.kv_cache import StepBatch, init_cache

    n, T = windows.shape
    pages = math.ceil(T / page_size)
    total, count = 0.0, 0
    for start in range(0, n - n % batch_size, batch_size):
        rows = windows[start : start + batch_size].astype(np.int32)
        cache = init_cache(cfg, batch_size * pages + 1, page_size, dtype, kv_cache_dtype=kv_cache_dtype)
        batch = StepBatch(tokens=rows[None], start_pos=np.zeros((1, batch_size), np.int32),
                          num_new=np.full((1, batch_size), T, np.int32),
                          page_table=np.arange(1, batch_size * pages + 1, dtype=np.int32).reshape(1, batch_size, pages))
        s, c = _nll_sum(params, cache, batch, cfg=cfg)
        total, count = total + float(s), count + int(c)
    return total / count


def heldout_windows(model_dir: str, num_windows: int, window_len: int) -> np.ndarray:
    from corpus import iter_texts
    from jaxserve.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    ids: list[int] = []
    for _, text in iter_texts("heldout"):
        ids.extend(tok.encode(text, add_special_tokens=False))
        if len(ids) >= num_windows * window_len:
            break
    if len(ids) < num_windows * window_len:
        raise SystemExit(f"the held-out split has only {len(ids)} tokens; ask for fewer windows")
    return np.asarray(ids[: num_windows * window_len], np.int32).reshape(num_windows, window_len)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/small")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--window-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)

    from jaxserve.config import EngineConfig
    from jaxserve.model_loader import load_model
    from jaxserve.sharding import make_mesh

    windows = heldout_windows(args.model, args.windows, args.window_len)
    dtype = jnp.dtype(args.dtype)
    loaded: dict[str, object] = {}
    results = {}
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        quantization, kv = VARIANTS[name]
        if quantization not in loaded:
            settings = EngineConfig(model=args.model, dtype=args.dtype, quantization=quantization)
            loaded[quantization] = load_model(settings, make_mesh((1, 1)), stacked=True)
        model = loaded[quantization]
        nll = mean_nll(model.params, model.cfg, windows, dtype, kv, args.batch_size)
        results[name] = {"nll": nll, "perplexity": math.exp(nll)}
        base = results.get("float", {}).get("perplexity")
        change = f" ({100 * (math.exp(nll) / base - 1):+.2f}% vs float)" if base and name != "float" else ""
        print(f"{name:14} perplexity {math.exp(nll):8.4f}{change}", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "tokens": int(windows.size), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
