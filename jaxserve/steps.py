"""The jit-compiled steps: the public step-level API for research code.

`ragged` is the engine's step: one flat batch of prompt chunks, decodes and verifications per
replica (`RaggedBatch`). `prefill` / `decode` take the rectangle `StepBatch` ([R, B, T] tokens:
research code, benchmarks and the quality scripts use them; the engine does not). All take
`(params, cache, batch)` and return `(logits, cache)`; the cache is donated (updated in place)
unless you call a `*_nodonate` variant.
The model config and step options are static, so one compilation serves every batch of a shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.model import quant
from jaxserve.errors import ConfigError
from jaxserve.model.kv_cache import KVCache, RaggedBatch, StepBatch
from jaxserve.model.layers import paged_attention_reference, ragged_attention_blocked
from jaxserve.model.llama import forward, forward_ragged, lm_head
from jaxserve.model.weights import Params
from jaxserve.model.sharding import DATA, MODEL, ExpertParallel, _local_kv_heads, shard_attention


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static choices of how a step is computed (hashable: part of the compilation key)."""

    scan_layers: bool = False
    all_logits: bool = False
    attention_backend: str = "reference"
    # The (data, model) mesh the step runs on. Needed only by the Pallas backends on more than one
    # device: GSPMD cannot split a kernel, so attention then runs per device under jax.shard_map.
    mesh: Mesh | None = None
    # How int8 (QuantArray) weights are multiplied: one of quant.MATMUL_IMPLS (the engine resolves
    # the user's quantized_matmul_backend); float weights ignore it.
    matmul_backend: str = "reference"
    # How a mixture of experts uses the mesh's model axis (sharding.MOE_PARALLELISMS): "expert" runs
    # each device's own experts under shard_map (the params laid out by make_shardings(...,
    # moe_parallelism="expert")); "tensor" leaves the experts, split on their hidden dimension, to GSPMD.
    moe_parallelism: str = "tensor"


# Resolved attention implementations (the engine turns the user's "auto" | "reference" | "pallas" into one).
ATTENTION_IMPLS = ("reference", "pallas_tpu", "pallas_gpu", "pallas_interpret")


def attention_impl(impl: str, mesh: Mesh | None = None):
    """The model's attention function; under a mesh of several devices the kernels run per shard."""
    if impl == "reference":
        return paged_attention_reference
    if impl in ("pallas_tpu", "pallas_gpu", "pallas_interpret"):
        # Interpret mode runs the GPU-style kernels on the CPU (slow; for testing).
        backend = "tpu" if impl == "pallas_tpu" else "gpu"
        fn = functools.partial(pallas_attention, backend=backend, interpret=impl == "pallas_interpret")
        return shard_attention(fn, mesh) if _per_shard(impl, mesh) else fn
    raise ValueError(f"unknown attention implementation {impl!r}; expected one of {ATTENTION_IMPLS}")


def expert_parallel_impl(cfg: ModelConfig, options: StepOptions) -> ExpertParallel | None:
    """The forward's `expert_parallel` argument: None unless a mixture of experts is expert-parallel on
    a model axis of several devices."""
    mesh = options.mesh
    if options.moe_parallelism != "expert" or not cfg.is_moe or mesh is None or mesh.shape[MODEL] == 1:
        return None
    return ExpertParallel(cfg, mesh)


def _per_shard(impl: str, mesh: Mesh | None) -> bool:
    return impl != "reference" and mesh is not None and mesh.size > 1


def pallas_attention(q, k_pages, v_pages, page_table, positions, seq_lens, sliding_window=None, *,
                     backend: str, interpret: bool, k_scale=None, v_scale=None):
    """The model's attention call on the Pallas kernels: the decode kernel for one token per row,
    the ragged kernel otherwise (valid tokens packed to the front, outputs scattered back).
    k_scale, v_scale f32[K, NP, S]: the scales of an int8 cache, dequantized inside the kernels."""
    from pallas_kernels import paged_attention, ragged_paged_attention

    B, T, N, H = q.shape
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if T == 1 and sliding_window is None:
        out = paged_attention(q[:, 0], k_pages, v_pages, seq_lens, page_table, backend=backend, interpret=interpret,
                              **scales)
        return out[:, None]
    num_new = seq_lens - positions[:, 0]  # i32[B]
    valid = (jnp.arange(T, dtype=jnp.int32)[None, :] < num_new[:, None]).reshape(B * T)
    order = jnp.argsort(~valid, stable=True)  # valid tokens first, in row order
    query_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(num_new, dtype=jnp.int32)])
    flat = ragged_paged_attention(
        q.reshape(B * T, N, H)[order], k_pages, v_pages, page_table, seq_lens, query_start, B,
        sliding_window=sliding_window, backend=backend, interpret=interpret, **scales,
    )
    out = jnp.zeros_like(flat).at[order].set(flat)
    return out.reshape(B, T, N, H)


def ragged_attention_impl(impl: str, mesh: Mesh | None = None):
    """The ragged step's attention function (`llama.RaggedAttentionFn`: the whole stacked cache and
    the layer index); under a mesh of several devices the kernels run per shard."""
    if impl == "reference":  # plain JAX: the blocked form of the reference (the keys each row sees only)
        return ragged_attention_blocked
    if impl in ("pallas_tpu", "pallas_gpu", "pallas_interpret"):
        # Interpret mode runs the GPU-style kernel on the CPU (slow; for testing).
        backend = "tpu" if impl == "pallas_tpu" else "gpu"
        fn = functools.partial(pallas_ragged_attention, backend=backend, interpret=impl == "pallas_interpret")
        return shard_ragged_attention(fn, mesh) if _per_shard(impl, mesh) else fn
    raise ValueError(f"unknown attention implementation {impl!r}; expected one of {ATTENTION_IMPLS}")


def pallas_ragged_attention(q, k_cache, v_cache, layer, positions, query_start, context_lens, page_table,
                            sliding_window=None, sm_scale=None, *, backend: str, interpret: bool, k_scale=None,
                            v_scale=None):
    """The ragged step's attention on the ragged kernel, which takes the whole stacked cache (k, v
    f[L, K, NP, S, H], int8 scales f32[L, K, NP, S]) and indexes it with `layer` itself.
    Every row slot is a kernel sequence (padding rows have no tokens); the kernel derives each
    token's position from context_lens and query_start, as `RaggedBatch` lays them out."""
    from pallas_kernels import ragged_paged_attention

    del positions
    return ragged_paged_attention(
        q, k_cache, v_cache, page_table, context_lens, query_start, page_table.shape[0], k_scale=k_scale,
        v_scale=v_scale, sm_scale=sm_scale, sliding_window=sliding_window, layer=layer, backend=backend,
        interpret=interpret,
    )


def shard_ragged_attention(attention, mesh: Mesh):
    """`attention` (the ragged step's per-replica call) once per device under `jax.shard_map`, as
    `sharding.shard_attention` does for the rectangle steps: query heads split on `model`; the
    stacked cache's KV-head axis (axis 1, scales too) on `model` when it divides them, else
    replicated; the batch arrays, layer, window and scale whole. The replica axis comes from the
    caller's `jax.vmap(..., spmd_axis_name="data")`. With replicated KV heads each device takes its
    query heads' KV heads of this layer first: a per-layer copy of those pages (correct, extra
    traffic), attended as a one-layer stack; prefer a model axis dividing K."""
    model = mesh.shape[MODEL]
    whole, heads = PartitionSpec(), PartitionSpec(None, MODEL, None)

    def wrapped(q, k_cache, v_cache, layer, positions, query_start, context_lens, page_table,
                sliding_window=None, sm_scale=None, k_scale=None, v_scale=None):
        # q f[N, heads, H]; k_cache, v_cache f[L, K, NP, S, H]; k_scale, v_scale f32[L, K, NP, S] | None
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
        if num_heads % model:
            raise ConfigError(f"the model axis ({model}) must divide the {num_heads} query heads")
        kv_split = num_kv_heads % model == 0
        kv_spec = PartitionSpec(None, MODEL if kv_split else None)
        scales = () if k_scale is None else (k_scale, v_scale)

        def per_device(q, k_cache, v_cache, layer, positions, query_start, context_lens, page_table, window,
                       scale, *scales):
            kv = (k_cache, v_cache, *scales)
            if not kv_split:
                kv = tuple(a[None] for a in _local_kv_heads(tuple(a[layer] for a in kv), num_heads // model,
                                                            num_heads // num_kv_heads))
                layer = jnp.int32(0)
            kw = {} if not scales else dict(k_scale=kv[2], v_scale=kv[3])
            return attention(q, kv[0], kv[1], layer, positions, query_start, context_lens, page_table, window,
                             scale, **kw)

        in_specs = (heads, kv_spec, kv_spec, *(whole,) * 7, *(kv_spec for _ in scales))
        # check_vma=False: a pallas_call's outputs carry no varying-axes type (jax asks kernels to declare it).
        return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)(
            q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), positions, query_start, context_lens, page_table,
            sliding_window, sm_scale, *scales)

    return wrapped


def model_step(
    params: Params, cache: KVCache, batch: StepBatch, cfg: ModelConfig, options: StepOptions = StepOptions()
) -> tuple[jax.Array, KVCache]:
    """logits f32[R, B, V] (or f32[R, B, T, V] with all_logits) and the updated cache."""
    fwd = functools.partial(
        forward,
        cfg=cfg,
        scan_layers=options.scan_layers,
        all_logits=options.all_logits,
        attention=attention_impl(options.attention_backend, options.mesh),
        matmul=options.matmul_backend,
        expert_parallel=expert_parallel_impl(cfg, options),
    )
    # A shard_map inside the vmap maps the replica axis onto `data` through spmd_axis_name.
    spmd = DATA if _per_shard(options.attention_backend, options.mesh) else None
    # The cache pytree (scales too, when int8) is mapped over its leading replica axis.
    return jax.vmap(fwd, in_axes=(None, 0, 0, 0, 0, 0), spmd_axis_name=spmd)(
        params, cache, batch.tokens, batch.start_pos, batch.num_new, batch.page_table
    )


def _check_decode(batch: StepBatch) -> None:
    if batch.tokens.shape[-1] != 1:
        raise ValueError(f"decode takes one token per sequence; got tokens of shape {batch.tokens.shape}")


def _decode(params, cache, batch, cfg, options=StepOptions()):
    _check_decode(batch)
    return model_step(params, cache, batch, cfg, options)


def ragged_step(
    params: Params, cache: KVCache, batch: RaggedBatch, cfg: ModelConfig, options: StepOptions = StepOptions(),
    hidden: bool = False,
) -> tuple[jax.Array, KVCache]:
    """One ragged step of every replica (`batch`: `RaggedBatch.stack` of one per replica): prompt
    chunks, decodes and verifications in one flat token axis. Returns logits f32[R, L, V] at each
    replica's `logit_index`, and the updated cache (docs/ARCHITECTURE.md, "The ragged step"). With
    `hidden`, the final-normed hidden states f[R, L, D] instead (`ragged_logits` finishes them).

    Every attention backend of `ATTENTION_IMPLS`: the Pallas ones get each replica's whole stacked
    cache and the layer index (no per-layer slice), per device under `shard_map` on a mesh of several
    devices. The replica `vmap` over the GPU kernel is one more grid axis; over the TPU kernel it is
    free when each device holds one replica (the size-1 axis of its scalar-prefetch operands is
    squeezed away), while several replicas on one device make Pallas loop over them, slicing each
    replica's cache (correct, not fast)."""
    if options.all_logits:
        raise ValueError("the ragged step returns the logits at logit_index (list every token there for all "
                         "of them); all_logits is for the rectangle steps")
    fwd = functools.partial(forward_ragged, cfg=cfg, scan_layers=options.scan_layers, matmul=options.matmul_backend,
                            attention=ragged_attention_impl(options.attention_backend, options.mesh),
                            expert_parallel=expert_parallel_impl(cfg, options), hidden=hidden)
    # A shard_map inside the vmap maps the replica axis onto `data` through spmd_axis_name.
    spmd = DATA if _per_shard(options.attention_backend, options.mesh) else None
    return jax.vmap(fwd, in_axes=(None, 0, 0), spmd_axis_name=spmd)(params, cache, batch)


def ragged_logits(params: Params, hidden: jax.Array, cfg: ModelConfig, options: StepOptions = StepOptions()):
    """Logits f32[..., V] of `ragged_step(..., hidden=True)`'s hidden states (any leading axes)."""
    if options.matmul_backend != "reference":
        params = quant.with_kernel(params, options.matmul_backend)
    return lm_head(params, cfg, hidden)


_STATIC = ("cfg", "options")
prefill = jax.jit(model_step, static_argnames=_STATIC, donate_argnames=("cache",))
decode = jax.jit(_decode, static_argnames=_STATIC, donate_argnames=("cache",))
prefill_nodonate = jax.jit(model_step, static_argnames=_STATIC)
decode_nodonate = jax.jit(_decode, static_argnames=_STATIC)
ragged = jax.jit(ragged_step, static_argnames=_STATIC, donate_argnames=("cache",))
ragged_nodonate = jax.jit(ragged_step, static_argnames=_STATIC)
