"""The compiled speculative step: propose (draft loop, or the host's n-gram tokens), verify all k+1
positions in one target pass over the paged cache, accept on device. One dispatch, one transfer back.
The runner lowers, compiles and calls it (`jaxserve.engine.spec_steps`), as it does every step.

Verification is the prefill computation: the target takes [pending token, d_1..d_k] at positions
pos..pos+k (each layer writes their K/V, then attends causally over the pages) and returns the logits
of every position. K/V written for drafts that end up rejected sit past the sequence's length and
are overwritten by later steps.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache, StepBatch
from jaxserve.model.weights import Params
from jaxserve.sampling import SamplingTensors
from jaxserve.spec_decode.draft import propose
from jaxserve.spec_decode.rejection import VerifyOutput, verify
from jaxserve.steps import StepOptions, model_step
from jaxserve.transfer import from_buffer

VERIFY = "verify"  # the tag of a verify step's executable key (batch, pages, drafts, VERIFY) in the runner


@dataclasses.dataclass(frozen=True)
class SpecOptions:
    """Static choices of the speculative step (part of its compilation key)."""

    method: str  # "draft" | "ngram"
    num_tokens: int  # draft positions per row in this executable; the target verifies num_tokens + 1
    accept_all: bool = False  # a deliberately wrong verifier, only for the test that must catch it


@flax.struct.dataclass
class SpecInputs:
    """One speculative step for B rows of each of R replicas."""

    last_token: jax.Array  # i32[R, B]  the pending token (sampled last step; its K/V not yet cached)
    pos: jax.Array  # i32[R, B]  its position = tokens already in the target's cache
    num_new: jax.Array  # i32[R, B]  1 + drafts to verify; 0 = padding row
    page_table: jax.Array  # i32[R, B, P]  shared by the target and the draft
    drafts: jax.Array  # i32[R, B, K]  n-gram proposals (the draft method makes its own)
    draft_tokens: jax.Array  # i32[R, B, 2]  draft method: the tokens its cache lacks, ending at the pending one
    draft_start: jax.Array  # i32[R, B]  position of draft_tokens[0]
    draft_len: jax.Array  # i32[R, B]  1 or 2 (0 = padding row)
    want_logprobs: jax.Array  # bool[R, B]  rows that return logprobs (the top-N costs a vocabulary-wide top-k)


def constrain(cache: KVCache | None, shardings: KVCache | None) -> KVCache | None:
    """Keep a donated cache's layout stable from step to step (shardings: a KVCache of shardings)."""
    if cache is None or shardings is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, shardings)


def spec_step(
    params: Params,
    cache: KVCache,
    draft_params: Params | None,
    draft_cache: KVCache | None,
    inputs: SpecInputs,
    sampling: SamplingTensors,  # [R, B]
    *,
    cfg: ModelConfig,
    draft_cfg: ModelConfig | None,
    options: StepOptions,
    spec: SpecOptions,
    cache_sharding: KVCache | None = None,
    draft_cache_sharding: KVCache | None = None,
    out_sharding: jax.sharding.Sharding | None = None,
) -> tuple[VerifyOutput, KVCache, KVCache | None]:
    """VerifyOutput with leading axes [R, B], and both caches. `out_sharding`: on a mesh spanning
    processes, the outputs replicated, so that process 0 can read all of them."""
    R, B = inputs.pos.shape
    K = spec.num_tokens
    num_draft = jnp.maximum(inputs.num_new - 1, 0)
    st = jax.tree.map(lambda x: x.reshape((R * B,) + x.shape[2:]), sampling)
    if spec.method == "draft":
        first = StepBatch(tokens=inputs.draft_tokens, start_pos=inputs.draft_start, num_new=inputs.draft_len,
                          page_table=inputs.page_table)
        drafts, draft_probs, draft_cache = propose(draft_params, draft_cache, first, num_draft, st, cfg=draft_cfg,
                                                   options=options, num_tokens=K)
        draft_probs = draft_probs.reshape(R * B, K, -1)
        draft_cache = constrain(draft_cache, draft_cache_sharding)
    else:
        drafts, draft_probs = inputs.drafts, None
    tokens = jnp.concatenate([inputs.last_token[..., None], drafts], axis=-1)  # i32[R, B, K + 1]
    batch = StepBatch(tokens=tokens, start_pos=inputs.pos, num_new=inputs.num_new, page_table=inputs.page_table)
    logits, cache = model_step(params, cache, batch, cfg, dataclasses.replace(options, all_logits=True))
    cache = constrain(cache, cache_sharding)
    out = verify(logits.reshape(R * B, K + 1, -1), drafts.reshape(R * B, K), draft_probs,
                 num_draft.reshape(R * B), st, inputs.want_logprobs.reshape(R * B), accept_all=spec.accept_all)
    out = jax.tree.map(lambda x: x.reshape((R, B) + x.shape[1:]), out)
    if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out, cache, draft_cache


# Compiled as (params, cache, draft params, draft cache, packed inputs): see jaxserve.transfer.
spec_step_jit = jax.jit(from_buffer(spec_step, 4), static_argnames=(
    "layout", "cfg", "draft_cfg", "options", "spec", "cache_sharding", "draft_cache_sharding", "out_sharding"),
    donate_argnums=(1, 3))


def draft_prefill(params: Params, cache: KVCache, batch: StepBatch, *, cfg: ModelConfig, options: StepOptions,
                  cache_sharding: KVCache | None = None) -> KVCache:
    """Write a chunk of tokens into the draft's cache (alongside the target's prefill, or to catch up)."""
    _, cache = model_step(params, cache, batch, cfg, options)  # the logits are unused: XLA drops them
    return constrain(cache, cache_sharding)


draft_prefill_jit = jax.jit(from_buffer(draft_prefill, 2), static_argnames=(
    "layout", "cfg", "options", "cache_sharding"), donate_argnums=(1,))
