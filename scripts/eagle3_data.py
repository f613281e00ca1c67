#!/usr/bin/env python
"""Training data for an EAGLE-3 head: the target's own answers and its hidden states over them.

An EAGLE-3 head drafts from three of the target's layers' hidden states, so it must be trained on
what the target computes, over text the target writes: the prompts (scripts/eagle3_prompts.py,
from the stdlib) are rendered with the model's chat template, answered by the target through
jaxserve's engine, and then run once more through the target (a dense forward over prompt + answer
with the same decoder layer the engine runs) to keep, per token:

* `aux`: the residual stream entering each aux layer (HF's `hidden_states[i]`; vLLM's default
  layers 2, L // 2, L - 3), concatenated in that order, bf16 [N, 3 * D];
* `final`: the final-normed state, bf16 [N, D] (the trainer applies the target's lm_head to it,
  restricted to the draft vocabulary, for the loss's target distribution: exact, and 1/14 of the
  bytes the restricted logits would take);
* `greedy`: the target's argmax next token after each token, i32 [N] (held-out acceptance).

Phases, each resumable (a finished shard is never redone; files are written then renamed):
`prompts` -> `generate` -> `states` -> `vocab`. Greedy answers by default (`--temperature 0`): the
acceptance the head is judged on is greedy decoding's, so greedy answers are exactly the contexts
it will draft in; `--temperature` > 0 gives more varied contexts instead.

    python scripts/eagle3_data.py --work-dir ~/.cache/jaxserve/eagle3 --train-prompts 2000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zlib
from pathlib import Path

import numpy as np

SHARD_FILES = ("tokens", "offsets", "prompt_lens", "aux", "final", "greedy")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 aux layers for a target of `num_layers` layers."""
    return (2, num_layers // 2, num_layers - 3)


# ---- bf16 on disk: numpy has no bfloat16, so its bits are kept as uint16 ----


def to_bf16_bits(x) -> np.ndarray:
    import ml_dtypes

    return np.asarray(x).astype(ml_dtypes.bfloat16).view(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.asarray(bits).view(ml_dtypes.bfloat16)


# ---- the target's states: the engine's decoder layer, dense, keeping the layers' inputs ----


def make_states_fn(cfg, aux_layers: tuple[int, ...]):
    """jit: (params, tokens i32[B, T]) -> (aux f32[B, T, len(aux) * D], final f32[B, T, D],
    greedy i32[B, T]). Sequences start at position 0; right padding does not reach real tokens
    (causal attention)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model import llama
    from jaxserve.model.layers import causal_attention

    if cfg.layer_types or cfg.query_pre_attn_scalar is not None:
        raise ValueError("eagle3_data handles uniform-layer (Llama-like) targets")
    if max(aux_layers) >= cfg.num_layers:
        raise ValueError(f"aux layers {aux_layers} past the target's {cfg.num_layers} layers")

    def states(params, tokens):
        B, T = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        cos, sin, _ = llama.rope_tables(cfg, positions)
        x = llama._embed(params, cfg, tokens)

        def body(lp, layer, x, carry):
            attend = lambda q, k, v: causal_attention(q, k, v, cfg.sliding_window, None)
            return llama.decoder_layer(cfg, lp, x, cos, sin, attend), carry

        x, _, kept = llama.layer_loop(
            params.layers, cfg.num_layers, x, None, body, scan=True, observe=lambda h: h.astype(jnp.float32)
        )
        aux = jnp.concatenate([kept[i] for i in aux_layers], axis=-1)
        final = llama._norm(cfg, x, params.final_norm)
        greedy = jnp.argmax(llama.lm_head(params, cfg, final), axis=-1).astype(jnp.int32)
        return aux, final.astype(jnp.float32), greedy

    return jax.jit(states)


def compute_states(states_fn, params, seqs: list[list[int]], tokens_per_batch: int = 2048, bucket: int = 128):
    """Run `states_fn` over `seqs` in length-sorted, padded batches; per sequence (aux, final,
    greedy) as numpy arrays of its own length."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list = [None] * len(seqs)
    i = 0
    while i < len(order):
        T = -(-len(seqs[order[i]]) // bucket) * bucket
        rows = max(1, tokens_per_batch // T)  # one batch shape per length bucket: one compile each
        group = []
        while i < len(order) and len(seqs[order[i]]) <= T and len(group) < rows:
            group.append(order[i])
            i += 1
        batch = np.zeros((rows, T), np.int32)
        for r, j in enumerate(group):
            batch[r, : len(seqs[j])] = seqs[j]
        aux, final, greedy = (np.asarray(a) for a in states_fn(params, batch))
        for r, j in enumerate(group):
            n = len(seqs[j])
            out[j] = (aux[r, :n], final[r, :n], greedy[r, :n])
    return out


# ---- shards on disk ----


def write_shard(folder: Path, records: list[dict], states: list) -> None:
    """One shard: the sequences (prompt + answer ids) back to back, `offsets` i64[S + 1] bounding
    them, their prompt lengths, and the states per token. Written to a temporary folder, renamed."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    seqs = [r["prompt_ids"] + r["answer_ids"] for r in records]
    offsets = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
    arrays = {
        "tokens": np.concatenate([np.asarray(s, np.int32) for s in seqs]),
        "offsets": offsets,
        "prompt_lens": np.asarray([len(r["prompt_ids"]) for r in records], np.int32),
        "aux": to_bf16_bits(np.concatenate([s[0] for s in states])),
        "final": to_bf16_bits(np.concatenate([s[1] for s in states])),
        "greedy": np.concatenate([s[2] for s in states]).astype(np.int32),
    }
    for name, array in arrays.items():
        np.save(tmp / f"{name}.npy", array)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def read_shard(folder: Path, mmap: bool = True) -> dict[str, np.ndarray]:
    """A shard's arrays (aux and final as bf16 views; memory-mapped unless `mmap` is False)."""
    mode = "r" if mmap else None
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode=mode) for name in SHARD_FILES}
    arrays["aux"] = from_bf16_bits(arrays["aux"])
    arrays["final"] = from_bf16_bits(arrays["final"])
    return arrays


def shard_dirs(work: Path, split: str) -> list[Path]:
    root = work / "states" / split
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".tmp")) if root.is_dir() else []


# ---- phases ----


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.rename(path)


def _note(work: Path, phase: str, **figures) -> None:
    """Add figures to work/stats.json (per phase, summed over resumed runs)."""
    path = work / "stats.json"
    stats = json.loads(path.read_text()) if path.is_file() else {}
    entry = stats.setdefault(phase, {})
    for key, value in figures.items():
        entry[key] = round(entry.get(key, 0) + value, 3) if isinstance(value, (int, float)) else value
    _write_json(path, stats)


def phase_prompts(args, work: Path) -> None:
    from eagle3_prompts import build_prompts

    for split, count in (("train", args.train_prompts), ("heldout", args.heldout_prompts)):
        path = work / "prompts" / f"{split}.jsonl"
        if path.is_file() and sum(1 for _ in path.open()) == count:
            continue
        start = time.perf_counter()
        prompts = build_prompts(split, count, args.seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(p) + "\n" for p in prompts))
        tmp.rename(path)
        _note(work, f"prompts_{split}", prompts=len(prompts), seconds=time.perf_counter() - start)
        print(f"prompts {split}: {len(prompts)} -> {path}", flush=True)


def _shards(work: Path, split: str, shard_size: int) -> list[tuple[str, list[dict]]]:
    """(name, prompts) of each shard: named by the range of prompts it holds, so a data set grown
    by more prompts keeps every whole shard and redoes only a partial last one."""
    prompts = [json.loads(line) for line in (work / "prompts" / f"{split}.jsonl").open()]
    return [
        (f"{split}-{i:06d}-{min(i + shard_size, len(prompts)):06d}", prompts[i : i + shard_size])
        for i in range(0, len(prompts), shard_size)
    ]


def phase_generate(args, work: Path) -> None:
    """The target's answers, shard by shard (one batched generate call each)."""
    shards = [
        (split, name, shard) for split in ("train", "heldout") for name, shard in _shards(work, split, args.shard_size)
    ]
    wanted = {name for _, name, _ in shards}
    (work / "gen").mkdir(exist_ok=True)
    for stale in (work / "gen").glob("*.jsonl"):  # shards of an earlier prompt count or shard size
        if stale.stem not in wanted:
            stale.unlink()
            shutil.rmtree(work / "states" / stale.stem.split("-")[0] / stale.stem, ignore_errors=True)
    todo = [(split, name, shard) for split, name, shard in shards if not (work / "gen" / f"{name}.jsonl").is_file()]
    if not todo:
        return
    from jaxserve import LLM, SamplingParams
    from jaxserve.server.chat import build_chat_renderer

    start = time.perf_counter()
    llm = LLM(
        args.model,
        max_model_len=args.max_prompt_tokens + args.max_new_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=1024,
    )
    _note(work, "generate", engine_start_seconds=time.perf_counter() - start)
    renderer = build_chat_renderer(llm.tokenizer, llm.config.chat_template)
    eos = set(llm.tokenizer.eos_token_ids)
    for split, name, shard in todo:
        start = time.perf_counter()
        kept, ids = [], []
        for p in shard:
            prompt = llm.engine.processor.chat_prompt([{"role": "user", "content": p["content"]}], renderer)
            if len(prompt.token_ids) <= args.max_prompt_tokens:
                kept.append(p)
                ids.append(prompt.token_ids)
        params = [
            SamplingParams(
                max_tokens=args.max_new_tokens,
                temperature=args.temperature,
                repetition_penalty=1.0,
                seed=None if args.temperature == 0 else zlib.crc32(f"{args.seed}-{p['id']}".encode()),
            )
            for p in kept
        ]
        outs = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
        lines, new = [], 0
        for p, prompt_ids, out in zip(kept, ids, outs):
            answer = list(out.outputs[0].token_ids)
            reason = out.outputs[0].finish_reason
            if reason == "stop" and (not answer or answer[-1] not in eos):
                answer.append(llm.tokenizer.eos_token_id)  # the stop token, as the target saw it
            new += len(out.outputs[0].token_ids)
            lines.append(json.dumps({"id": p["id"], "prompt_ids": list(prompt_ids), "answer_ids": answer}) + "\n")
        path = work / "gen" / f"{name}.jsonl"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(lines))
        tmp.rename(path)
        seconds = time.perf_counter() - start
        _note(work, "generate", prompts=len(kept), dropped_long=len(shard) - len(kept), new_tokens=new, seconds=seconds)
        print(f"generate {path.name}: {len(kept)} answers, {new} tokens, {new / seconds:.0f} tok/s", flush=True)
    llm.close()


def load_target(model: str | None, dtype: str = "float32"):
    """(ModelConfig, Params, model_dir) of `model` (None: the default model) as the engine loads it."""
    import jax.numpy as jnp

    from jaxserve.config import ModelConfig
    from jaxserve.loading.checkpoint import load_hf_params
    from jaxserve.loading.model_source import resolve_model_path

    model_dir = resolve_model_path(model)
    cfg = ModelConfig.from_dir(model_dir)
    return cfg, load_hf_params(model_dir, cfg, jnp.dtype(dtype)), model_dir


def phase_states(args, work: Path) -> None:
    """Hidden states over every generated shard."""
    todo = [
        path
        for path in sorted((work / "gen").glob("*.jsonl"))
        if not (work / "states" / path.stem.split("-")[0] / path.stem).is_dir()
    ]
    if not todo:
        return
    start = time.perf_counter()
    cfg, params, _ = load_target(args.model)
    aux_layers = default_aux_layers(cfg.num_layers)
    states_fn = make_states_fn(cfg, aux_layers)
    _write_json(
        work / "target.json",
        {
            "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "aux_layers": list(aux_layers),
        },
    )
    _note(work, "states", load_seconds=time.perf_counter() - start)
    for path in todo:
        start = time.perf_counter()
        records = [json.loads(line) for line in path.open()]
        seqs = [r["prompt_ids"] + r["answer_ids"] for r in records]
        states = compute_states(states_fn, params, seqs, args.tokens_per_batch)
        split = path.stem.split("-")[0]
        write_shard(work / "states" / split / path.stem, records, states)
        tokens = sum(len(s) for s in seqs)
        answer = [r["answer_ids"] for r in records]
        agree = sum(
            int(np.sum(s[2][len(r["prompt_ids"]) - 1 : -1] == np.asarray(a)))
            for s, r, a in zip(states, records, answer)
        )
        seconds = time.perf_counter() - start
        _note(work, "states", tokens=tokens, answer_tokens=sum(map(len, answer)), greedy_agree=agree, seconds=seconds)
        print(
            f"states {path.stem}: {tokens} tokens, {tokens / seconds:.0f} tok/s; the dense forward's argmax "
            f"equals the engine's answer on {agree}/{sum(map(len, answer))} tokens",
            flush=True,
        )


def special_ids(tokenizer) -> set[int]:
    """The ids the chat scaffolding and the end of an answer use (always in the draft vocabulary)."""
    return set(tokenizer.all_special_ids) | set(tokenizer.eos_token_ids)


def answer_counts(work: Path, split: str, vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, np.int64)
    for folder in shard_dirs(work, split):
        s = read_shard(folder)
        for j, plen in enumerate(s["prompt_lens"]):
            counts += np.bincount(s["tokens"][s["offsets"][j] + plen : s["offsets"][j + 1]], minlength=vocab_size)
    return counts


def build_vocab(train_counts: np.ndarray, size: int, always: set[int]) -> np.ndarray:
    """The draft vocabulary: `always`, then the most frequent answer tokens, as target ids sorted
    ascending (draft id i -> target id d2t[i]); ties broken by the lower id."""
    always = sorted(i for i in always if i < len(train_counts))
    order = np.lexsort((np.arange(len(train_counts)), -train_counts))
    rest = [int(i) for i in order if i not in set(always)][: size - len(always)]
    return np.asarray(sorted(always + rest), np.int32)


def phase_vocab(args, work: Path) -> None:
    from jaxserve.loading.model_source import resolve_model_path
    from jaxserve.loading.tokenizer import load_tokenizer

    target = json.loads((work / "target.json").read_text())
    tokenizer = load_tokenizer(resolve_model_path(args.model))
    train = answer_counts(work, "train", target["vocab_size"])
    heldout = answer_counts(work, "heldout", target["vocab_size"])
    d2t = build_vocab(train, args.draft_vocab_size, special_ids(tokenizer))
    np.save(work / "d2t.npy", d2t)
    inside = np.zeros(target["vocab_size"], bool)
    inside[d2t] = True
    report = {
        "draft_vocab_size": len(d2t),
        "distinct_train_answer_tokens": int(np.sum(train > 0)),
        "coverage_train": round(float(train[inside].sum() / max(train.sum(), 1)), 4),
        "coverage_heldout": round(float(heldout[inside].sum() / max(heldout.sum(), 1)), 4),
        "train_answer_tokens": int(train.sum()),
        "heldout_answer_tokens": int(heldout.sum()),
    }
    _write_json(work / "vocab.json", report)
    print("vocab:", json.dumps(report), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", default=os.path.expanduser("~/.cache/jaxserve/eagle3"))
    ap.add_argument("--model", default=None, help="the target (default: the default model)")
    ap.add_argument("--phases", default="prompts,generate,states,vocab")
    ap.add_argument("--train-prompts", type=int, default=2000)
    ap.add_argument("--heldout-prompts", type=int, default=128)
    ap.add_argument("--shard-size", type=int, default=64, help="prompts per shard (the unit of resuming)")
    ap.add_argument("--max-prompt-tokens", type=int, default=448)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--tokens-per-batch", type=int, default=2048, help="tokens per states forward")
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    phases = {"prompts": phase_prompts, "generate": phase_generate, "states": phase_states, "vocab": phase_vocab}
    for name in args.phases.split(","):
        phases[name](args, work)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
