"""The jit-compiled steps: prefill a chunk / decode one token for every sequence of every replica.

These are the public step-level API for research code. They take `(params, cache, batch)` and return
`(logits, cache)`; the cache is donated (updated in place) unless you call a `*_nodonate` variant.
The model config and step options are static, so one compilation serves every batch of a shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache, RaggedBatch, StepBatch
from jaxserve.model.layers import paged_attention_reference
from jaxserve.model.llama import forward, forward_ragged
from jaxserve.model.weights import Params
from jaxserve.sharding import DATA, shard_attention


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
    params: Params, cache: KVCache, batch: RaggedBatch, cfg: ModelConfig, options: StepOptions = StepOptions()
) -> tuple[jax.Array, KVCache]:
    """One ragged step of every replica (`batch`: `RaggedBatch.stack` of one per replica): prompt
    chunks, decodes and verifications in one flat token axis. Returns logits f32[R, L, V] at each
    replica's `logit_index`, and the updated cache. The engine still runs `prefill`/`decode`; this
    is the layout it moves to (docs/ARCHITECTURE.md, "The ragged step"), with the plain-JAX attention."""
    if options.attention_backend != "reference" or options.all_logits:
        raise ValueError("the ragged step has the reference attention only and returns logits at logit_index "
                         f"(got attention_backend={options.attention_backend!r}, all_logits={options.all_logits})")
    fwd = functools.partial(forward_ragged, cfg=cfg, scan_layers=options.scan_layers, matmul=options.matmul_backend)
    return jax.vmap(fwd, in_axes=(None, 0, 0))(params, cache, batch)


_STATIC = ("cfg", "options")
prefill = jax.jit(model_step, static_argnames=_STATIC, donate_argnames=("cache",))
decode = jax.jit(_decode, static_argnames=_STATIC, donate_argnames=("cache",))
prefill_nodonate = jax.jit(model_step, static_argnames=_STATIC)
decode_nodonate = jax.jit(_decode, static_argnames=_STATIC)
ragged = jax.jit(ragged_step, static_argnames=_STATIC, donate_argnames=("cache",))
ragged_nodonate = jax.jit(ragged_step, static_argnames=_STATIC)
