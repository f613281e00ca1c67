"""Which function computes the ragged step's attention: the plain-JAX reference or a Pallas kernel,
and on a mesh of several devices the kernel run once per device under `jax.shard_map` (GSPMD cannot
split a kernel). The attention math itself lives in `layers` and `pallas_kernels`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxserve.errors import ConfigError
from jaxserve.model.layers import ragged_attention_blocked
from jaxserve.model.sharding import MODEL, local_kv_heads

# Resolved attention implementations (the engine turns the user's "auto" | "reference" | "pallas" into one).
ATTENTION_IMPLS = ("reference", "pallas_tpu", "pallas_gpu", "pallas_interpret")


def runs_per_shard(impl: str, mesh: Mesh | None) -> bool:
    """Whether `impl` runs once per device under shard_map (a kernel on a mesh of several devices)."""
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
        return shard_ragged_attention(fn, mesh) if runs_per_shard(impl, mesh) else fn
    raise ValueError(f"unknown attention implementation {impl!r}; expected one of {ATTENTION_IMPLS}")


def pallas_ragged_attention(
    q,
    k_cache,
    v_cache,
    layer,
    positions,
    query_start,
    context_lens,
    page_table,
    sliding_window=None,
    sm_scale=None,
    *,
    backend: str,
    interpret: bool,
    k_scale=None,
    v_scale=None,
):
    """The ragged step's attention on the ragged kernel, which takes the whole stacked cache (k, v
    f[L, K, NP, S, H], int8 scales f32[L, K, NP, S]) and indexes it with `layer` itself.
    Every row slot is a kernel sequence (padding rows have no tokens); the kernel derives each
    token's position from context_lens and query_start, as `RaggedBatch` lays them out."""
    from pallas_kernels import ragged_paged_attention

    del positions
    return ragged_paged_attention(
        q,
        k_cache,
        v_cache,
        page_table,
        context_lens,
        query_start,
        page_table.shape[0],
        k_scale=k_scale,
        v_scale=v_scale,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        layer=layer,
        backend=backend,
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

    def wrapped(
        q,
        k_cache,
        v_cache,
        layer,
        positions,
        query_start,
        context_lens,
        page_table,
        sliding_window=None,
        sm_scale=None,
        k_scale=None,
        v_scale=None,
    ):
        # q f[N, heads, H]; k_cache, v_cache f[L, K, NP, S, H]; k_scale, v_scale f32[L, K, NP, S] | None
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
        if num_heads % model:
            raise ConfigError(f"the model axis ({model}) must divide the {num_heads} query heads")
        kv_split = num_kv_heads % model == 0
        kv_spec = PartitionSpec(None, MODEL if kv_split else None)
        scales = () if k_scale is None else (k_scale, v_scale)

        def per_device(
            q, k_cache, v_cache, layer, positions, query_start, context_lens, page_table, window, scale, *scales
        ):
            kv = (k_cache, v_cache, *scales)
            if not kv_split:
                kv = tuple(
                    a[None]
                    for a in local_kv_heads(tuple(a[layer] for a in kv), num_heads // model, num_heads // num_kv_heads)
                )
                layer = jnp.int32(0)
            kw = {} if not scales else dict(k_scale=kv[2], v_scale=kv[3])
            return attention(
                q, kv[0], kv[1], layer, positions, query_start, context_lens, page_table, window, scale, **kw
            )

        in_specs = (heads, kv_spec, kv_spec, *(whole,) * 7, *(kv_spec for _ in scales))
        # check_vma=False: a pallas_call's outputs carry no varying-axes type (jax asks kernels to declare it).
        return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)(
            q,
            k_cache,
            v_cache,
            jnp.asarray(layer, jnp.int32),
            positions,
            query_start,
            context_lens,
            page_table,
            sliding_window,
            sm_scale,
            *scales,
        )

    return wrapped
