"""The model runner: packs scheduled work into bucketed arrays, calls the compiled step, fetches tokens.

It is the only place where host state becomes device arrays. Each (batch, tokens, pages) bucket is
compiled once ahead of time; the cache is donated into every call and replaced by the result.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine.compile import BucketTable, CompileCounter, pick_bucket
from jaxserve.kv_cache import KVCache, StepBatch
from jaxserve.model.weights import Params
from jaxserve.sampling import SamplingTensors, sample
from jaxserve.steps import StepOptions, model_step

logger = logging.getLogger(__name__)

PADDING_PAGE = 0  # page 0 of every replica is never given to a sequence; padding rows point at it


@dataclasses.dataclass
class RowWork:
    """One sequence's share of a step: compute `tokens` starting at `start_pos`, then sample one token."""

    tokens: Sequence[int]
    start_pos: int
    page_ids: Sequence[int]
    sampling: tuple[float, int, float, int, int] = (0.0, 0, 1.0, 0, 0)  # temperature, top_k, top_p, seed, step
    replica: int = 0


def _generate_step(params, cache, batch, sampling, cfg, options, cache_sharding=None):
    logits, cache = model_step(params, cache, batch, cfg, options)  # f32[R, B, V]
    if cache_sharding is not None:  # keep the donated cache's layout stable from step to step
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding)
    R, B, V = logits.shape
    flat = jax.tree.map(lambda x: jnp.broadcast_to(x, (R, B)).reshape(R * B), sampling)
    tokens = sample(logits.reshape(R * B, V), flat).reshape(R, B)
    return tokens, cache


_generate_step_jit = jax.jit(
    _generate_step, static_argnames=("cfg", "options", "cache_sharding"), donate_argnames=("cache",)
)


class ModelRunner:
    """Owns params and the KV cache; runs one bucketed step at a time."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        cache: KVCache,
        buckets: BucketTable,
        options: StepOptions = StepOptions(),
        shardings: Any = None,
    ):
        self.cfg = cfg
        self.params = params
        self.cache = cache
        self.buckets = buckets
        self.options = options
        self.shardings = shardings  # jaxserve.sharding.Shardings or None
        self.num_replicas = cache.num_replicas
        self._executables: dict[tuple[int, int, int], Any] = {}
        self.unplanned_compiles = 0  # shapes that were not in the warmed table
        CompileCounter.install()

    # ---- compilation ---------------------------------------------------------------------------
    def step_shapes(self) -> list[tuple[int, int, int]]:
        """Every (batch, tokens, pages) the engine may run: decodes and prefill chunks."""
        b, t, p = self.buckets.batch_sizes, self.buckets.chunk_sizes, self.buckets.page_counts
        decode = [(bs, 1, pc) for bs in b for pc in p]
        prefill = [(bs, ts, pc) for ts in t for bs in b if bs * ts <= max(t) for pc in p]
        return decode + prefill

    def _abstract_inputs(self, shape: tuple[int, int, int]):
        B, T, P = shape
        R = self.num_replicas
        sh = self.shardings
        def spec(dims, dtype, sharding=None):
            return jax.ShapeDtypeStruct(dims, dtype, sharding=sharding)
        batch = StepBatch(
            tokens=spec((R, B, T), jnp.int32, sh and sh.batch3),
            start_pos=spec((R, B), jnp.int32, sh and sh.batch2),
            num_new=spec((R, B), jnp.int32, sh and sh.batch2),
            page_table=spec((R, B, P), jnp.int32, sh and sh.batch3),
        )
        sampling = SamplingTensors(
            temperature=spec((R, B), jnp.float32, sh and sh.batch2),
            top_k=spec((R, B), jnp.int32, sh and sh.batch2),
            top_p=spec((R, B), jnp.float32, sh and sh.batch2),
            seed=spec((R, B), jnp.uint32, sh and sh.batch2),
            step=spec((R, B), jnp.int32, sh and sh.batch2),
        )
        return batch, sampling

    def compile(self, shape: tuple[int, int, int]):
        executable = self._executables.get(shape)
        if executable is None:
            batch, sampling = self._abstract_inputs(shape)
            lowered = _generate_step_jit.trace(
                self.params, self.cache, batch, sampling, cfg=self.cfg, options=self.options,
                cache_sharding=self.shardings.cache if self.shardings is not None else None,
            ).lower()
            executable = self._executables[shape] = lowered.compile()
        return executable

    def warm_up(self, shapes: list[tuple[int, int, int]] | None = None, progress: bool = True) -> list[tuple]:
        """Compile every bucket ahead of time; returns (shape, seconds) per bucket."""
        from tqdm import tqdm

        shapes = shapes if shapes is not None else self.step_shapes()
        timings = []
        for shape in tqdm(shapes, desc="compiling step buckets", disable=not progress, unit="bucket"):
            start = time.perf_counter()
            self.compile(shape)
            timings.append((shape, time.perf_counter() - start))
        for (B, T, P), seconds in timings:
            logger.info("bucket batch=%d tokens=%d pages=%d compiled in %.2fs", B, T, P, seconds)
        return timings

    # ---- execution -----------------------------------------------------------------------------
    def execute(self, rows: Sequence[RowWork]) -> np.ndarray:
        """Run one step for `rows` (any mix of replicas); returns the sampled token of each row."""
        R = self.num_replicas
        per_replica = [[i for i, r in enumerate(rows) if r.replica == rep] for rep in range(R)]
        B = pick_bucket(max(len(p) for p in per_replica), self.buckets.batch_sizes)
        max_tokens = max(len(r.tokens) for r in rows)
        T = 1 if max_tokens == 1 else pick_bucket(max_tokens, self.buckets.chunk_sizes)
        P = pick_bucket(max(len(r.page_ids) for r in rows), self.buckets.page_counts)
        tokens = np.zeros((R, B, T), np.int32)
        start = np.zeros((R, B), np.int32)
        num_new = np.zeros((R, B), np.int32)
        table = np.full((R, B, P), PADDING_PAGE, np.int32)
        sampling = np.zeros((R, B, 5), np.float64)
        sampling[..., 2] = 1.0
        for rep, indices in enumerate(per_replica):
            for b, i in enumerate(indices):
                row = rows[i]
                tokens[rep, b, : len(row.tokens)] = row.tokens
                start[rep, b] = row.start_pos
                num_new[rep, b] = len(row.tokens)
                table[rep, b, : len(row.page_ids)] = row.page_ids
                sampling[rep, b] = row.sampling
        shape = (B, T, P)
        if shape not in self._executables:
            self.unplanned_compiles += 1
            logger.warning("compiling unplanned step shape batch=%d tokens=%d pages=%d", *shape)
        executable = self.compile(shape)
        batch = StepBatch(tokens=tokens, start_pos=start, num_new=num_new, page_table=table)
        st = SamplingTensors(
            temperature=sampling[..., 0].astype(np.float32),
            top_k=sampling[..., 1].astype(np.int32),
            top_p=sampling[..., 2].astype(np.float32),
            seed=sampling[..., 3].astype(np.uint32),
            step=sampling[..., 4].astype(np.int32),
        )
        if self.shardings is not None:
            batch = StepBatch(
                tokens=jax.device_put(tokens, self.shardings.batch3),
                start_pos=jax.device_put(start, self.shardings.batch2),
                num_new=jax.device_put(num_new, self.shardings.batch2),
                page_table=jax.device_put(table, self.shardings.batch3),
            )
            st = jax.device_put(st, self.shardings.batch2)
        out, self.cache = executable(self.params, self.cache, batch, st)
        out = np.asarray(out)
        result = np.empty(len(rows), np.int32)
        for rep, indices in enumerate(per_replica):
            result[indices] = out[rep, : len(indices)]
        return result
