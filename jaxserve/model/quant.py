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
DENSE_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
LINEAR_FIELDS = DENSE_FIELDS + ("expert_gate", "expert_up", "expert_down")
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


def matmul(x: jax.Array, w: jax.Array | QuantArray | Int4Array, preferred_element_type: Any = None) -> jax.Array:
    """x [..., in] @ w [in, out] for a float or a quantized weight; the result in x's dtype, or in
    `preferred_element_type` when given (the logits, in f32)."""
    if not is_quant(w):
        if preferred_element_type is None:
            return x @ w
        return jnp.matmul(x, w, preferred_element_type=preferred_element_type)
    out_dtype = preferred_element_type or x.dtype
    if isinstance(w, Int4Array):
        return int4_matmul(x, w).astype(out_dtype)
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
    # at least 8 rows: a wide weight (a quantized head, [D, V]) streams in chunks of 8 rows, not widened whole
    while k % (2 * rows) == 0 and 2 * rows < k and (2 * rows * n * 4 <= CHUNK_BYTES or rows < 8):
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
    return isinstance(x, (QuantArray, Int4Array))


def with_kernel(tree: Any, kernel: str) -> Any:
    """Every QuantArray of `tree` set to compute with `kernel` (one of MATMUL_IMPLS)."""
    if kernel not in MATMUL_IMPLS:
        raise ValueError(f"unknown matmul implementation {kernel!r}; expected one of {MATMUL_IMPLS}")
    return jax.tree.map(lambda x: x.replace(kernel=kernel) if is_quant(x) else x, tree, is_leaf=is_quant)


# ---- int4: weight-only, asymmetric per group of input rows ----------------------------------------
INT4_MAX = 15
INT4_GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1 block: their files load into it exactly


@flax.struct.dataclass
class Int4Array:
    """A weight stored as 4-bit codes, two per byte along `in`, with an f32 scale and bias per group of
    `group_size` input rows and output channel: w[k, n] = q[k, n] * scales[k // G, n] + biases[k // G, n].

    Row 2i is the low nibble of values[i], row 2i + 1 the high one (the layout of
    pallas_kernels/int4_matmul). `kernel` as QuantArray's."""

    values: jax.Array  # u8[..., in // 2, out]
    scales: jax.Array  # f32[..., in // group_size, out]
    biases: jax.Array  # f32[..., in // group_size, out]
    group_size: int = flax.struct.field(pytree_node=False, default=INT4_GROUP_SIZE)
    kernel: str = flax.struct.field(pytree_node=False, default="reference")

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, half, n = self.values.shape
        return (*lead, 2 * half, n)


def quantize_int4(w: jax.Array, group_size: int = INT4_GROUP_SIZE) -> Int4Array:
    """Asymmetric int4 of w f[..., in, out]: each group's min maps to 0 and its max to 15."""
    *lead, k, n = w.shape
    if group_size % 2 or k % group_size:
        raise ValueError(f"int4 group size {group_size} must be even and divide the input dimension {k}")
    g = w.astype(jnp.float32).reshape(*lead, k // group_size, group_size, n)
    lo, hi = jnp.min(g, axis=-2), jnp.max(g, axis=-2)  # f32[..., in // G, out]
    scales = (hi - lo) / INT4_MAX
    safe = jnp.where(scales > 0, scales, 1.0)  # a constant group is its bias exactly
    q = jnp.clip(jnp.round((g - lo[..., None, :]) / safe[..., None, :]), 0, INT4_MAX).astype(jnp.uint8)
    return Int4Array(values=pack_nibbles(q.reshape(*lead, k, n)), scales=scales, biases=lo, group_size=group_size)


def pack_nibbles(q: jax.Array) -> jax.Array:
    """u8[..., K, N] codes 0..15 -> u8[..., K // 2, N]: even rows low nibbles, odd rows high."""
    return q[..., 0::2, :] | (q[..., 1::2, :] << 4)


def _dequant_half(codes: jax.Array, w: Int4Array, scales: jax.Array, biases: jax.Array, dtype: Any) -> jax.Array:
    """Codes u8[..., R, N] of the even (or odd) rows of R // (G/2) whole groups, dequantized."""
    *lead, r, n = codes.shape
    half = w.group_size // 2
    q = codes.astype(jnp.float32).reshape(*lead, r // half, half, n)
    return (q * scales[..., None, :] + biases[..., None, :]).astype(dtype).reshape(*lead, r, n)


def dequantize_int4(w: Int4Array, dtype: Any = jnp.float32) -> jax.Array:
    even = _dequant_half(w.values & 0xF, w, w.scales, w.biases, dtype)
    odd = _dequant_half(w.values >> 4, w, w.scales, w.biases, dtype)
    *lead, half, n = w.values.shape
    return jnp.stack([even, odd], axis=-2).reshape(*lead, 2 * half, n)


def int4_matmul(x: jax.Array, w: Int4Array) -> jax.Array:
    """x f[..., in] @ w: f32[..., out]. Decode rows on one device ("xla_cpu") stream the packed bytes
    in chunks (`_int4_chunked`); the Pallas kernels (`pallas_kernels.int4_matmul`) unpack in-register
    on TPU and GPU; everything else (prefill on a CPU, the XLA reference) dequantizes the weight in
    x's dtype and multiplies."""
    rows = _int4_chunk_rows(x, w) if w.kernel == "xla_cpu" else 0
    if rows:
        return _int4_chunked(x, w, rows)
    if w.kernel.startswith("pallas"):
        return _pallas_int4_matmul(x, w)
    return jnp.matmul(x, dequantize_int4(w, x.dtype), preferred_element_type=jnp.float32)


def _pallas_int4_matmul(x: jax.Array, w: Int4Array) -> jax.Array:
    from pallas_kernels import int4_matmul as kernel

    if w.kernel not in MATMUL_IMPLS:
        raise ValueError(f"unknown matmul implementation {w.kernel!r}; expected one of {MATMUL_IMPLS}")
    backend = "tpu" if w.kernel == "pallas_tpu" else "gpu"
    lead, k = x.shape[:-1], x.shape[-1]
    y = kernel(x.reshape(-1, k), w.values, w.scales, w.biases, group_size=w.group_size, backend=backend,
               interpret=w.kernel == "pallas_interpret")
    return y.reshape(*lead, w.values.shape[-1]).astype(jnp.float32)


def _int4_chunk_rows(x: jax.Array, w: Int4Array) -> int:
    """Packed rows per chunk: whole groups, dividing in // 2, the two widened halves near CHUNK_BYTES."""
    kp, n = w.values.shape[-2:]
    half = w.group_size // 2
    if w.values.ndim != 2 or x.size // (2 * kp) > CHUNK_MAX_ROWS:
        return 0
    fits = [r for r in range(half, kp + 1, half) if kp % r == 0 and 2 * r * n * 4 <= CHUNK_BYTES]
    return max(fits, default=half)


def _int4_chunked(x: jax.Array, w: Int4Array, rows: int) -> jax.Array:
    """x @ w as a loop over chunks of `rows` packed rows: each chunk's low and high nibbles are widened
    and scaled right before their partial products with x's even and odd columns, so neither the
    nibbles nor the widened weight are ever interleaved or written out whole."""
    kp, n = w.values.shape
    steps, groups = kp // rows, rows // (w.group_size // 2)
    lead = x.shape[:-1]
    xs = x.reshape(*lead, steps, rows, 2)  # [..., chunk, packed row, even/odd]
    values = w.values.reshape(steps, rows, n)
    scales = w.scales.reshape(steps, groups, n)
    biases = w.biases.reshape(steps, groups, n)

    def body(i, acc):
        xi = jax.lax.dynamic_index_in_dim(xs, i, axis=-3, keepdims=False)  # [..., rows, 2]
        v = jax.lax.dynamic_index_in_dim(values, i, axis=0, keepdims=False)
        s = jax.lax.dynamic_index_in_dim(scales, i, axis=0, keepdims=False)
        b = jax.lax.dynamic_index_in_dim(biases, i, axis=0, keepdims=False)
        even = _dequant_half(v & 0xF, w, s, b, x.dtype)
        odd = _dequant_half(v >> 4, w, s, b, x.dtype)
        acc = acc + jnp.matmul(xi[..., 0], even, preferred_element_type=jnp.float32)
        return acc + jnp.matmul(xi[..., 1], odd, preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(0, steps, body, jnp.zeros((*lead, n), jnp.float32))


# ---- the quantized params layout ----------------------------------------------------------------
def quantized_fields(quantization: str) -> tuple[str, ...]:
    """The LayerParams fields `quantization` replaces: int8 all linear weights; int4 the dense ones
    (model.moe multiplies int8 or float experts only, so int4 leaves the experts as they are)."""
    return {"int8": LINEAR_FIELDS, "int4": DENSE_FIELDS}.get(quantization, ())


def map_linear(params: Params, fn: Callable[[Any], Any], quantize_lm_head: bool = False,
               fields: tuple[str, ...] = LINEAR_FIELDS) -> Params:
    """Apply `fn` to every linear weight (of `fields`) of a Params-shaped tree (arrays, axis names,
    shardings, ...).

    Works on stacked layers and on a tuple of per-layer LayerParams; norms and biases are left as they
    are; lm_head is included when `quantize_lm_head`, and a tied head (lm_head None) is the embedding
    table, then quantized as the head [D, V] (`fn` of it transposed; `embed_rows` reads it).
    """
    def one(lp: LayerParams) -> LayerParams:  # a family's absent weights (None) stay absent
        return lp.replace(**{f: fn(getattr(lp, f)) for f in fields if getattr(lp, f) is not None})

    layers = params.layers
    layers = tuple(one(lp) for lp in layers) if isinstance(layers, tuple) else one(layers)
    lm_head, embed = params.lm_head, params.embed
    if quantize_lm_head and lm_head is not None:
        lm_head = fn(lm_head)
    elif quantize_lm_head and embed is not None:  # tied: the table, quantized as the head [D, V] it is
        embed = fn(_transposed(embed))
    return params.replace(layers=layers, lm_head=lm_head, embed=embed)


def _transposed(x: Any) -> Any:
    """The [D, V] head of a tied [V, D] table: an array transposed, logical axes reversed, else x."""
    if isinstance(x, tuple):
        return x[::-1]
    return x.T if hasattr(x, "T") else x


def embed_rows(table: QuantArray | Int4Array, tokens: jax.Array, dtype: Any) -> jax.Array:
    """Rows f[*tokens.shape, D] of a quantized tied table (stored as the head, [D, V]): only the
    gathered columns are dequantized."""
    if isinstance(table, QuantArray):
        values = jnp.moveaxis(jnp.take(table.values, tokens, axis=-1), 0, -1)  # i8[..., D]
        return (values.astype(jnp.float32) * jnp.take(table.scales, tokens)[..., None]).astype(dtype)
    packed = jnp.moveaxis(jnp.take(table.values, tokens, axis=-1), 0, -1)  # u8[..., D // 2]
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1)  # u8[..., D // 2, 2]
    scales = jnp.moveaxis(jnp.take(table.scales, tokens, axis=-1), 0, -1)  # f32[..., D // G]
    biases = jnp.moveaxis(jnp.take(table.biases, tokens, axis=-1), 0, -1)
    groups = codes.reshape(*tokens.shape, scales.shape[-1], table.group_size).astype(jnp.float32)
    rows = groups * scales[..., None] + biases[..., None]
    return rows.reshape(*tokens.shape, -1).astype(dtype)


def quantized_axes(axes: tuple[str | None, ...]) -> QuantArray:
    """Logical axes of a quantized weight: values keep the weight's, scales drop the `in` axis."""
    return QuantArray(values=axes, scales=axes[:-2] + axes[-1:])


def int4_axes(axes: tuple[str | None, ...]) -> Int4Array:
    """Logical axes of an int4 weight: packed values and per-group scales and biases keep the weight's
    (a device holding some input rows holds their bytes and their groups')."""
    return Int4Array(values=axes, scales=axes, biases=axes)


def quantized_layout(params: Params, quantization: str, quantize_lm_head: bool = False) -> Params:
    """A Params-shaped tree of logical axes in the layout of `quantization` ("none" leaves it)."""
    if quantization == "int8":
        return map_linear(params, quantized_axes, quantize_lm_head)
    if quantization == "int4":
        return map_linear(params, int4_axes, quantize_lm_head, DENSE_FIELDS)
    return params


def quantize_params(params: Params, quantize_lm_head: bool = False, quantization: str = "int8") -> Params:
    fn = quantize_int4 if quantization == "int4" else quantize
    return map_linear(params, fn, quantize_lm_head, quantized_fields(quantization))


def quantize_params_placed(params: Params, shardings: Params, quantize_lm_head: bool = False,
                           quantization: str = "int8") -> Params:
    """Quantize params already on their devices, one weight at a time, each result on its sharding.

    Consumes `params`: each float weight is deleted as soon as its int8 form exists, so device memory
    peaks near the float model plus one weight, never two float copies. `shardings` is the quantized
    layout (`sharding.make_shardings(..., quantization=quantization)`)."""
    jitted: dict[Any, Callable] = {}
    fn = quantize_int4 if quantization == "int4" else quantize

    def quantize_one(w: jax.Array, sharding: Any, transpose: bool) -> Any:
        if (sharding, transpose) not in jitted:
            jitted[sharding, transpose] = jax.jit(lambda w: fn(w.T if transpose else w), out_shardings=sharding)
        q = jitted[sharding, transpose](w)
        w.delete()  # the runtime frees it once the quantize that reads it is done
        return q

    marks = map_linear(jax.tree.map(lambda _: False, params), lambda _: True, quantize_lm_head,
                       quantized_fields(quantization))
    leaves, treedef = jax.tree.flatten(params)
    targets = jax.tree.leaves(shardings, is_leaf=is_quant)
    tied = quantize_lm_head and params.lm_head is None
    out = [quantize_one(w, sh, tied and w is params.embed) if mark else w
           for w, mark, sh in zip(leaves, jax.tree.leaves(marks), targets)]
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
