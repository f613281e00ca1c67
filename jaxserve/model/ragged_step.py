"""The engine's step body: one ragged step of every replica (`RaggedBatch`), the forward with the
attention, int8 matmul and expert parallelism that `StepOptions` choose. Every compiled step of the
engine (plain, scoring, multi-step, speculative) and the research steps (`jaxserve.steps`) run it."""

from __future__ import annotations

import functools

import jax

from jaxserve.config import ModelConfig
from jaxserve.model import quant
from jaxserve.model.attention_dispatch import ragged_attention_impl, runs_per_shard
from jaxserve.model.hidden_states import HiddenStates
from jaxserve.model.kv_cache import KVCache, RaggedBatch
from jaxserve.model.llama import forward_ragged, lm_head
from jaxserve.model.sharding import DATA, MODEL, ExpertParallel
from jaxserve.model.step_options import StepOptions
from jaxserve.model.weights import Params


def expert_parallel_impl(cfg: ModelConfig, options: StepOptions) -> ExpertParallel | None:
    """The forward's `expert_parallel` argument: None unless a mixture of experts is expert-parallel on
    a model axis of several devices."""
    mesh = options.mesh
    if options.moe_parallelism != "expert" or not cfg.is_moe or mesh is None or mesh.shape[MODEL] == 1:
        return None
    return ExpertParallel(cfg, mesh)


def ragged_step(
    params: Params,
    cache: KVCache,
    batch: RaggedBatch,
    cfg: ModelConfig,
    options: StepOptions = StepOptions(),
    hidden: bool = False,
    states: HiddenStates | None = None,
    state_index: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """One ragged step of every replica (`batch`: `RaggedBatch.stack` of one per replica): prompt
    chunks, decodes and verifications in one flat token axis. Returns logits f32[R, L, V] at each
    replica's `logit_index` (list every token there for all of them), and the updated cache
    (docs/ARCHITECTURE.md, "The ragged step"). With `hidden`, the final-normed hidden states
    f[R, L, D] instead (`ragged_logits` finishes them). With `states` (static), a `HiddenOutput` of
    [R, ...] in place of the logits: chosen layers' and the final-normed states at `state_index`
    i32[R, M] (indices into each replica's flat token axis), per-row sums (`model/hidden_states.py`).

    Every attention backend of `ATTENTION_IMPLS`: the Pallas ones get each replica's whole stacked
    cache and the layer index (no per-layer slice), per device under `shard_map` on a mesh of several
    devices. The replica `vmap` over the GPU kernel is one more grid axis; over the TPU kernel it is
    free when each device holds one replica (the size-1 axis of its scalar-prefetch operands is
    squeezed away), while several replicas on one device make Pallas loop over them, slicing each
    replica's cache (correct, not fast)."""
    fwd = functools.partial(
        forward_ragged,
        cfg=cfg,
        scan_layers=options.scan_layers,
        matmul=options.matmul_backend,
        attention=ragged_attention_impl(options.attention_backend, options.mesh),
        expert_parallel=expert_parallel_impl(cfg, options),
        hidden=hidden,
        states=states,
    )
    # A shard_map inside the vmap maps the replica axis onto `data` through spmd_axis_name.
    spmd = DATA if runs_per_shard(options.attention_backend, options.mesh) else None
    if states is None or not states.needs_index:
        return jax.vmap(fwd, in_axes=(None, 0, 0), spmd_axis_name=spmd)(params, cache, batch)
    at = lambda p, c, b, i: fwd(p, c, b, state_index=i)
    return jax.vmap(at, in_axes=(None, 0, 0, 0), spmd_axis_name=spmd)(params, cache, batch, state_index)


def ragged_logits(params: Params, hidden: jax.Array, cfg: ModelConfig, options: StepOptions = StepOptions()):
    """Logits f32[..., V] of `ragged_step(..., hidden=True)`'s hidden states (any leading axes)."""
    if options.matmul_backend != "reference":
        params = quant.with_kernel(params, options.matmul_backend)
    return lm_head(params, cfg, hidden)
