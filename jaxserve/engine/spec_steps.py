"""The speculative executables, as the runner holds them: the verify step (`spec_decode.step`: propose
with the draft or take the host's n-gram tokens, verify k + 1 positions, accept on device) and the
draft's prefill. Their bucket keys, input specs, lowering and calls; `ModelRunner` owns them like its
ragged steps (one executable table, compiled by its warm-up, run and broadcast to the other processes
of a multi-host job by `run_step`). `jaxserve.spec_decode` decides what to run and packs it.

Keys: (batch, pages, drafts, "verify") and (batch, tokens, pages, "draft").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.engine.buckets import DRAFT, BucketTable, speculative_shapes
from jaxserve.kv_cache import KVCache, StepBatch, cache_shardings, init_cache
from jaxserve.model.weights import Params
from jaxserve.sampling import SamplingTensors
from jaxserve.spec_decode.step import VERIFY, SpecInputs, SpecOptions, draft_prefill_jit, spec_step_jit
from jaxserve.transfer import Layout

SPECULATIVE = (VERIFY, DRAFT)


@dataclasses.dataclass
class Speculation:
    """What the speculative executables take besides the target: the static choices, and the draft's
    params and KV cache (same page ids as the target's), which the runner holds and donates."""

    method: str  # "draft" | "ngram"
    num_tokens: int  # K, the most drafts a step verifies
    draft_cfg: ModelConfig | None = None
    draft_params: Params | None = None
    draft_cache: KVCache | None = None
    draft_cache_sharding: KVCache | None = None
    accept_all: bool = False  # a deliberately wrong verifier: only the test that must catch it sets this

    @classmethod
    def load(cls, method: str, num_tokens: int, draft: Any, num_pages: int, page_size: int,
             num_replicas: int) -> Speculation:
        """`draft`: the loaded draft model (method "draft"; its cache is allocated here) or None."""
        if draft is None:
            return cls(method, num_tokens)
        cache = init_cache(draft.cfg, num_pages, page_size, draft.dtype, num_replicas, draft.shardings.cache)
        return cls(method, num_tokens, draft.cfg, draft.params, cache, cache_shardings(draft.shardings, "auto"))


def is_speculative(shape: tuple) -> bool:
    return shape[-1] in SPECULATIVE


def spec_shapes(buckets: BucketTable, spec: Speculation | None, platform: str) -> list[tuple]:
    """Every speculative executable's key (`buckets.speculative_shapes`, the verify steps tagged)."""
    if spec is None:
        return []
    return [s if s[-1] == DRAFT else s + (VERIFY,)
            for s in speculative_shapes(buckets, spec.num_tokens, spec.method, platform)]


def step_inputs(shape: tuple, num_replicas: int, history_len: int) -> tuple:
    """ShapeDtypeStructs of a speculative step's host inputs, as `ModelRunner.run_packed` takes them:
    (SpecInputs, SamplingTensors) of [R, B] rows for a verify step, (StepBatch,) for the draft's prefill."""
    R = num_replicas

    def i32(*dims):
        return jax.ShapeDtypeStruct((R,) + dims, jnp.int32)

    if shape[-1] == DRAFT:
        B, T, P, _ = shape
        return (StepBatch(tokens=i32(B, T), start_pos=i32(B), num_new=i32(B), page_table=i32(B, P)),)
    B, P, d, _ = shape
    inputs = SpecInputs(last_token=i32(B), pos=i32(B), num_new=i32(B), page_table=i32(B, P), drafts=i32(B, d),
                        draft_tokens=i32(B, 2), draft_start=i32(B), draft_len=i32(B),
                        want_logprobs=jax.ShapeDtypeStruct((R, B), jnp.bool_))
    return inputs, SamplingTensors.spec((R, B), history_len)


def lower(runner: Any, shape: tuple, layout: Layout):
    """Lower a speculative step for the runner's params, caches and shardings (inputs packed by `layout`)."""
    spec = runner.speculation
    buffer = layout.spec(runner.buffer_sharding)
    if shape[-1] == DRAFT:
        return draft_prefill_jit.trace(spec.draft_params, spec.draft_cache, buffer, layout=layout, cfg=spec.draft_cfg,
                                       options=runner.options, cache_sharding=spec.draft_cache_sharding).lower()
    cache_sharding = None if runner.shardings is None else cache_shardings(
        runner.shardings, "int8" if runner.cache.quantized else "auto")
    options = SpecOptions(method=spec.method, num_tokens=shape[2], accept_all=spec.accept_all)
    return spec_step_jit.trace(
        runner.params, runner.cache, spec.draft_params, spec.draft_cache, buffer, layout=layout, cfg=runner.cfg,
        draft_cfg=spec.draft_cfg, options=runner.options, spec=options, cache_sharding=cache_sharding,
        draft_cache_sharding=spec.draft_cache_sharding, out_sharding=runner.out_sharding).lower()


def call(runner: Any, executable: Any, shape: tuple, buffer: jax.Array) -> Any:
    """Run a compiled speculative step on packed device inputs, replacing the donated caches. Returns
    the VerifyOutput ([R, B] leading, on the device) of a verify step, the draft's cache of a prefill."""
    spec = runner.speculation
    if shape[-1] == DRAFT:
        spec.draft_cache = executable(spec.draft_params, spec.draft_cache, buffer)
        return spec.draft_cache
    out, runner.cache, spec.draft_cache = executable(runner.params, runner.cache, spec.draft_params,
                                                     spec.draft_cache, buffer)
    return out
