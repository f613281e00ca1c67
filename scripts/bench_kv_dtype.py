#!/usr/bin/env python
"""What each KV cache storage costs a decode step's cache traffic on this machine: one layer's write of
the step's K/V (`kv_cache.write_kv_slots`) and its attention over the pages (`kv_cache.attend` on the
engine's CPU attention, `layers.ragged_attention_blocked`) for a batch of decode rows of long context,
with the cache in the model dtype, int8 (per-slot scales) or float8 (vLLM's fp8 = e4m3, and e5m2: XLA
widens every page it reads). The layer is the default model's (SmolLM2-135M: 9 query heads, 3 KV heads
of 64); the weights play no part. Variants are timed round-robin, so a shared machine's load falls on
all of them alike: compare the ratios of one run.

    python scripts/bench_kv_dtype.py [--rows 16 --context 2048 --repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.model.kv_cache import RaggedBatch, attend, init_cache, write_kv_slots  # noqa: E402
from jaxserve.model.layers import ragged_attention_blocked  # noqa: E402

VARIANTS = ("auto", "int8", "fp8", "fp8_e5m2")


def step_fn(cfg: ModelConfig):
    """One layer of a decode step: write the rows' new K/V, then attend over their pages."""

    def step(cache, q, k, v, batch):
        cache = write_kv_slots(cache, 0, k, v, batch.slots)
        out = attend(ragged_attention_blocked, q, cache, 0, batch, jnp.int32(2**30), jnp.float32(cfg.head_dim**-0.5))
        return out, cache

    return jax.jit(step, donate_argnums=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16, help="decode rows (one new token each)")
    ap.add_argument("--context", type=int, default=2048, help="tokens in each row's cache")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    cfg = ModelConfig.from_dir(str(Path(__file__).resolve().parents[1] / "configs" / "models" / "smollm2-135m"))
    cfg = ModelConfig(**{**cfg.__dict__, "num_layers": 1})
    R, P, S = args.rows, -(-args.context // args.page_size), args.page_size
    rng = np.random.default_rng(0)
    rows = [
        (rng.integers(1, 100, 1).tolist(), args.context - 1, list(range(1 + r * P, 1 + (r + 1) * P))) for r in range(R)
    ]
    batch = RaggedBatch.build(rows, page_size=S, num_tokens=R, num_rows=R, max_pages=P, num_logits=R)
    batch = jax.tree.map(jnp.asarray, batch)
    q = jnp.asarray(rng.standard_normal((R, cfg.num_heads, cfg.head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((R, cfg.num_kv_heads, cfg.head_dim)), jnp.float32) for _ in range(2))
    history = rng.standard_normal((1, 1, cfg.num_kv_heads, R * P + 1, S, cfg.head_dim)).astype(np.float32)
    step = step_fn(cfg)
    caches, times = {}, {name: [] for name in VARIANTS}
    for name in VARIANTS:  # every cache full of the same history, as it stores it
        cache = jax.tree.map(lambda x: x[0], init_cache(cfg, R * P + 1, S, jnp.float32, kv_cache_dtype=name))
        hist = jnp.asarray(history[0])
        slots = jnp.arange(R * P * S, dtype=jnp.int32) + S  # every slot of pages 1.. (page 0: padding)
        flat = hist[:, :, 1:].reshape(cfg.num_kv_heads, -1, cfg.head_dim).transpose(1, 0, 2)
        cache = jax.jit(write_kv_slots)(cache, 0, flat, flat, slots)
        out, cache = step(cache, q, k, v, batch)  # compile
        out.block_until_ready()
        caches[name] = cache
    for _ in range(args.repeats):
        for name in VARIANTS:
            t = time.perf_counter()
            out, caches[name] = step(caches[name], q, k, v, batch)
            out.block_until_ready()
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["auto"])
    result = {}
    print(
        f"{R} decode rows x {args.context} tokens of context, one layer ({cfg.num_heads} heads, "
        f"{cfg.num_kv_heads} KV heads of {cfg.head_dim}), median of {args.repeats}, jax {jax.__version__} on "
        f"{jax.default_backend()}"
    )
    for name in VARIANTS:
        ms = 1e3 * statistics.median(times[name])
        nbytes = sum(x.nbytes for x in jax.tree.leaves(caches[name]))
        result[name] = {"ms": ms, "vs_auto": ms / (1e3 * base), "cache_bytes": nbytes}
        print(f"{name:9} {ms:8.2f} ms  {ms / (1e3 * base):5.2f}x float32  cache {nbytes / 2**20:7.1f} MiB")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "jax": jax.__version__, "results": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
