"""The jit-compiled steps: the public step-level API for research code.

`ragged` is the engine's step: one flat batch of prompt chunks, decodes and verifications per
replica (`RaggedBatch`). `prefill` / `decode` take rows as a rectangle (`StepBatch`, [R, B, T]
tokens), the easier form to build by hand; they lay the rows out as a `RaggedBatch` on the device
and run the same step, so research code measures the forward and the attention that serve. All take
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
from jaxserve.model.layers import ragged_attention_blocked
from jaxserve.model.llama import forward_ragged, lm_head
from jaxserve.model.ragged import PAD_SLOT
from jaxserve.model.weights import Params
from jaxserve.model.sharding import DATA, MODEL, ExpertParallel, _local_kv_heads


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static choices of how a step is computed (hashable: part of the compilation key)."""

    scan_layers: bool = False
    # prefill / decode: logits at every token of every row (f32[R, B, T, V]), not only at its last.
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


def expert_parallel_impl(cfg: ModelConfig, options: StepOptions) -> ExpertParallel | None:
    """The forward's `expert_parallel` argument: None unless a mixture of experts is expert-parallel on
    a model axis of several devices."""
    mesh = options.mesh
    if options.moe_parallelism != "expert" or not cfg.is_moe or mesh is None or mesh.shape[MODEL] == 1:
        return None
    return ExpertParallel(cfg, mesh)


def _per_shard(impl: str, mesh: Mesh | None) -> bool:
    return impl != "reference" and mesh is not None and mesh.size > 1


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
    """`attention` (the ragged step's per-replica call) once per device under `jax.shard_map`:
    query heads split on `model`; the
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


def rows_as_ragged(batch: StepBatch, page_size: int, all_logits: bool) -> RaggedBatch:
    """One replica's rectangle rows (tokens i32[B, T], the rest i32[B] / i32[B, P]) in the ragged
    step's layout, on the device: each row's num_new tokens packed in row order (N = B * T, padding
    tokens after the last row), one row slot per row (S = B) and the logits at each row's last
    token (L = B), or at every token of every row with `all_logits` (L = B * T; tokens past a row's
    num_new repeat its last). Rows with num_new == 0 run as padding rows: no tokens, context 0.
    Pure array arithmetic on static shapes, so the rectangle steps stay one compilation per shape."""
    B, T = batch.tokens.shape
    num_new = jnp.clip(batch.num_new, 0, T)  # i32[B]
    query_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(num_new, dtype=jnp.int32)])  # i32[B+1]
    flat = jnp.arange(B * T, dtype=jnp.int32)
    real = flat < query_start[-1]  # bool[N]
    token_row = jnp.searchsorted(query_start[1:], flat, side="right").astype(jnp.int32)  # i32[N]; B past the rows
    row = jnp.minimum(token_row, B - 1)
    offset = flat - query_start[row]  # i32[N]  index of each token within its row
    positions = jnp.where(real, batch.start_pos[row] + offset, 0)
    page = batch.page_table.at[row, positions // page_size].get(mode="clip")
    last = query_start[:-1] + jnp.maximum(num_new - 1, 0)  # i32[B]
    if all_logits:
        last = jnp.minimum(query_start[:-1, None] + jnp.arange(T, dtype=jnp.int32), last[:, None])
    return RaggedBatch(
        tokens=jnp.where(real, batch.tokens.at[row, offset].get(mode="clip"), 0),
        positions=positions,
        slots=jnp.where(real, page * page_size + positions % page_size, PAD_SLOT),
        token_row=jnp.where(real, token_row, B),
        query_start=query_start,
        context_lens=jnp.where(num_new > 0, batch.start_pos + num_new, 0),
        page_table=batch.page_table,
        logit_index=jnp.minimum(last.reshape(-1), B * T - 1),
    )


def model_step(
    params: Params, cache: KVCache, batch: StepBatch, cfg: ModelConfig, options: StepOptions = StepOptions()
) -> tuple[jax.Array, KVCache]:
    """The rectangle steps' body: `batch`'s rows laid out by `rows_as_ragged`, then `ragged_step`.
    Returns logits f32[R, B, V] at each row's last token (f32[R, B, T, V] with all_logits) and the
    updated cache. Padding rows (num_new == 0) write nothing and their logits are meaningless."""
    R, B, T = batch.tokens.shape
    ragged_batch = jax.vmap(functools.partial(rows_as_ragged, page_size=cache.page_size,
                                              all_logits=options.all_logits))(batch)
    logits, cache = ragged_step(params, cache, ragged_batch, cfg, dataclasses.replace(options, all_logits=False))
    return (logits.reshape(R, B, T, -1) if options.all_logits else logits), cache


def _decode(params, cache, batch, cfg, options=StepOptions()):
    if batch.tokens.shape[-1] != 1:
        raise ValueError(f"decode takes one token per sequence; got tokens of shape {batch.tokens.shape}")
    return model_step(params, cache, batch, cfg, options)


_STATIC = ("cfg", "options")
prefill = jax.jit(model_step, static_argnames=_STATIC, donate_argnames=("cache",))
decode = jax.jit(_decode, static_argnames=_STATIC, donate_argnames=("cache",))
prefill_nodonate = jax.jit(model_step, static_argnames=_STATIC)
decode_nodonate = jax.jit(_decode, static_argnames=_STATIC)
ragged = jax.jit(ragged_step, static_argnames=_STATIC, donate_argnames=("cache",))
ragged_nodonate = jax.jit(ragged_step, static_argnames=_STATIC)
