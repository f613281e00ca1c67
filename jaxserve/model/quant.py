"""int8 quantization: weight-only per-output-channel linear layers (QuantArray) and the per-token,
per-head int8 KV cache arithmetic.

A quantized weight is a QuantArray pytree (`values` i8[..., in, out], `scales` f32[..., out]) that
stands wherever the float weight stood: stacked on a leading layer axis or per layer, sharded by the
same logical axes (the scales take the weight's `out` axis). `matmul` dispatches on it. Symmetric
absmax scaling: value = int8 * scale, scale = max|w| / 127 over the reduced axis, so the rounding
error of one element is at most scale / 2 = max|w| / 254.

The XLA ("reference") path computes `(x @ values.astype(x.dtype)) * scales`: the dequantized
temporary is one weight. XLA's default CPU scheduler converts every weight of the step up front
(all layers' dequantized weights alive at once, measured 425 MB for the SmolLM2-135M shape); the
memory-optimized scheduler (`engine.compile.step_compiler_options`) keeps one alive, which is also
about 2x faster. The engine's CPU default ("xla_cpu") goes further for decode: a loop over K chunks
of each weight, each widened right before its partial product, so no widened weight leaves the
cache (a temporary of one chunk, and faster than float32 weights).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

from jaxserve.model.weights import LayerParams, Params

INT8_MAX = 127
# The linear weights that quantization="int8" replaces ([in, out] each, experts [E, in, out]: a scale
# per expert and output channel; model.moe multiplies them itself, whatever `kernel`); lm_head only on
# request; never the routers.
LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "expert_gate", "expert_up", "expert_down")
# Resolved matmul implementations of a QuantArray: "reference" (XLA, any platform and mesh), "xla_cpu"
# (XLA, decode rows in cache-sized K chunks: one device's CPU), and the Pallas kernel per backend.
MATMUL_IMPLS = ("reference", "xla_cpu", "pallas_tpu", "pallas_gpu", "pallas_interpret")
# xla_cpu: the widened chunk of a weight (K rows x out x 4 bytes) aims at this size (about half a
# core's L2), and only products of at most this many rows are chunked (decode; prefill is
# compute-bound and converts once per many rows).
CHUNK_BYTES = 256 * 1024
CHUNK_MAX_ROWS = 16


@flax.struct.dataclass
class QuantArray:
    """A weight stored as int8 with one f32 scale per output channel: w ~= values * scales.

    `kernel` is static and always "reference" outside a step; the step sets it from StepOptions
    (`with_kernel`) so that checkpoints, shardings and params share one tree structure.
    """

    values: jax.Array  # i8[..., in, out]
    scales: jax.Array  # f32[..., out]
    kernel: str = flax.struct.field(pytree_node=False, default="reference")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


def quantize(w: jax.Array) -> QuantArray:
    """Symmetric per-output-channel int8 of w f[..., in, out]: the absmax over `in` maps to 127."""
    w32 = w.astype(jnp.float32)
    scales = jnp.max(jnp.abs(w32), axis=-2) / INT8_MAX  # f32[..., out]
    safe = jnp.where(scales > 0, scales, 1.0)  # an all-zero channel stays zero
    values = jnp.clip(jnp.round(w32 / safe[..., None, :]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantArray(values=values, scales=scales)


def dequantize(q: QuantArray, dtype: Any = jnp.float32) -> jax.Array:
    return (q.values.astype(jnp.float32) * q.scales[..., None, :]).astype(dtype)


def matmul(x: jax.Array, w: jax.Array | QuantArray, preferred_element_type: Any = None) -> jax.Array:
    """x [..., in] @ w [in, out] for a float or a quantized weight; the result in x's dtype, or in
    `preferred_element_type` when given (the logits, in f32)."""
    if not isinstance(w, QuantArray):
        if preferred_element_type is None:
            return x @ w
        return jnp.matmul(x, w, preferred_element_type=preferred_element_type)
    out_dtype = preferred_element_type or x.dtype
    if w.kernel == "xla_cpu" and _chunk_rows(x, w):
        return (_chunked_matmul(x, w.values, _chunk_rows(x, w)) * w.scales).astype(out_dtype)
    if w.kernel in ("reference", "xla_cpu"):
        # The int8 -> x.dtype convert is exact (|v| <= 127); the scale commutes with the k sum.
        y = jnp.matmul(x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)
        return (y * w.scales).astype(out_dtype)
    return _pallas_matmul(x.astype(out_dtype), w).astype(out_dtype)


def _chunk_rows(x: jax.Array, w: QuantArray) -> int:
    """Rows of `values` per chunk for the xla_cpu path (a power of two dividing K), 0 = do not chunk."""
    k, n = w.values.shape[-2:]
    if w.values.ndim != 2 or x.size // k > CHUNK_MAX_ROWS:
        return 0
    rows = 1
    while k % (2 * rows) == 0 and 2 * rows < k and 2 * rows * n * 4 <= CHUNK_BYTES:
        rows *= 2
    return rows if rows >= 8 else 0


def _chunked_matmul(x: jax.Array, values: jax.Array, rows: int) -> jax.Array:
    """f32 x [..., K] @ values i8[K, N] as a loop over K chunks: each chunk is widened right before its
    partial product, so the widened weight stays in cache instead of a whole f32 copy of it being
    written to and read back from memory (decode step of the SmolLM2-135M shape on this CPU: 51 ms
    against 62 ms with float32 weights and 91 ms widening whole weights)."""
    k, n = values.shape
    chunks = values.reshape(k // rows, rows, n)
    xs = x.reshape(*x.shape[:-1], k // rows, rows)

    def body(i, acc):
        xi = jax.lax.dynamic_index_in_dim(xs, i, axis=-2, keepdims=False)
        vi = jax.lax.dynamic_index_in_dim(chunks, i, axis=0, keepdims=False).astype(x.dtype)
        return acc + jnp.matmul(xi, vi, preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(0, k // rows, body, jnp.zeros((*x.shape[:-1], n), jnp.float32))


def _pallas_matmul(x: jax.Array, w: QuantArray) -> jax.Array:
    from pallas_kernels import int8_matmul

    if w.kernel not in MATMUL_IMPLS:
        raise ValueError(f"unknown matmul implementation {w.kernel!r}; expected one of {MATMUL_IMPLS}")
    backend = "tpu" if w.kernel == "pallas_tpu" else "gpu"
    lead, k = x.shape[:-1], x.shape[-1]
    y = int8_matmul(x.reshape(-1, k), w.values, w.scales, backend=backend, interpret=w.kernel == "pallas_interpret")
    return y.reshape(*lead, w.values.shape[-1])


def is_quant(x: Any) -> bool:
    return isinstance(x, QuantArray)


def with_kernel(tree: Any, kernel: str) -> Any:
    """Every QuantArray of `tree` set to compute with `kernel` (one of MATMUL_IMPLS)."""
    if kernel not in MATMUL_IMPLS:
        raise ValueError(f"unknown matmul implementation {kernel!r}; expected one of {MATMUL_IMPLS}")
    return jax.tree.map(lambda x: x.replace(kernel=kernel) if is_quant(x) else x, tree, is_leaf=is_quant)


# ---- the quantized params layout ----------------------------------------------------------------
def map_linear(params: Params, fn: Callable[[Any], Any], quantize_lm_head: bool = False) -> Params:
    """Apply `fn` to every linear weight of a Params-shaped tree (arrays, axis names, shardings, ...).

    Works on stacked layers and on a tuple of per-layer LayerParams; embeddings, norms and biases are
    left as they are; lm_head is included when `quantize_lm_head` (a tied head is the embedding: never).
    """
    def one(lp: LayerParams) -> LayerParams:  # a family's absent weights (None) stay absent
        return lp.replace(**{f: fn(getattr(lp, f)) for f in LINEAR_FIELDS if getattr(lp, f) is not None})

    layers = params.layers
    layers = tuple(one(lp) for lp in layers) if isinstance(layers, tuple) else one(layers)
    lm_head = params.lm_head
    if quantize_lm_head and lm_head is not None:
        lm_head = fn(lm_head)
    return params.replace(layers=layers, lm_head=lm_head)


def quantized_axes(axes: tuple[str | None, ...]) -> QuantArray:
    """Logical axes of a quantized weight: values keep the weight's, scales drop the `in` axis."""
    return QuantArray(values=axes, scales=axes[:-2] + axes[-1:])


def quantize_params(params: Params, quantize_lm_head: bool = False) -> Params:
    return map_linear(params, quantize, quantize_lm_head)


def quantize_params_placed(params: Params, shardings: Params, quantize_lm_head: bool = False) -> Params:
    """Quantize params already on their devices, one weight at a time, each result on its sharding.

    Consumes `params`: each float weight is deleted as soon as its int8 form exists, so device memory
    peaks near the float model plus one weight, never two float copies. `shardings` is the quantized
    layout (`sharding.make_shardings(..., quantization="int8")`)."""
    jitted: dict[Any, Callable] = {}

    def quantize_one(w: jax.Array, sharding: QuantArray) -> QuantArray:
        if sharding not in jitted:
            jitted[sharding] = jax.jit(quantize, out_shardings=sharding)
        q = jitted[sharding](w)
        w.delete()  # the runtime frees it once the quantize that reads it is done
        return q

    marks = map_linear(jax.tree.map(lambda _: False, params), lambda _: True, quantize_lm_head)
    leaves, treedef = jax.tree.flatten(params)
    targets = jax.tree.leaves(shardings, is_leaf=is_quant)
    out = [quantize_one(w, sh) if mark else w for w, mark, sh in zip(leaves, jax.tree.leaves(marks), targets)]
    return jax.tree.unflatten(treedef, out)  # a QuantArray stands where its float weight stood


# ---- int8 KV cache --------------------------------------------------------------------------------
def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-vector int8 of x f[..., H] (one K or V head of one token): (i8[..., H], f32[...])."""
    x32 = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(x32), axis=-1) / INT8_MAX
    safe = jnp.where(scales > 0, scales, 1.0)
    values = jnp.clip(jnp.round(x32 / safe[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return values, scales


def dequantize_kv(values: jax.Array, scales: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)
