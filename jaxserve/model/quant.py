"""Weight quantization (int8 and int4 linear layers) and the per-token, per-head int8 KV cache arithmetic.

A quantized weight is a pytree (QuantArray: int8; Int4Array: packed 4-bit codes) that stands wherever
the float weight stood: stacked on a leading layer axis or per layer, sharded by the same logical
axes. `matmul` dispatches on it.

int8 scales are per group of `group_size` input rows and output channel (scales f32[..., in // G,
out]; symmetric absmax: value = int8 * scale, scale = max|w| / 127 over the group) or, with
group_size 0, per output channel (scales f32[..., 1, out]). Per-channel scales commute with the sum
over `in`, so they scale the product once; group scales dequantize the weight (or its chunk) first.
Groups keep quality on real weights, where one outlier row would coarsen a whole channel.

On one CPU device (kernel "xla_cpu") decode rows multiply a weight chunk by chunk inside a loop, each
chunk widened right before its partial product, so no widened weight leaves the cache: XLA:CPU does
not fuse a widening convert into a dot, and a whole widened weight written to and read back from
memory costs more than the float32 weight itself. Narrow weights loop over chunks of input rows;
wide ones (a vocabulary head) over chunks of output columns, so the partial result is written once.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp

# the default group sizes are re-exported here, beside the formats they size
from jaxserve.config.model_config import (
    INT4_GROUP_SIZE,
    INT8_GROUP_SIZE,  # noqa: F401
    group_size_fitting,
    quantization_group_size,
)
from jaxserve.model.weights import LayerParams, Params

INT8_MAX = 127
# The linear weights that quantization="int8" / "int4" replaces ([in, out] each, experts [E, in, out]:
# int8 a scale per expert and output channel, int4 groups along each expert's `in`; model.moe multiplies
# them itself, whatever `kernel`); lm_head only on request; never the routers.
DENSE_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
EXPERT_FIELDS = ("expert_gate", "expert_up", "expert_down")
LINEAR_FIELDS = DENSE_FIELDS + EXPERT_FIELDS
# Resolved matmul implementations of a QuantArray: "reference" (XLA, any platform and mesh), "xla_cpu"
# (XLA, decode rows in cache-sized chunks: one device's CPU), "w8a8" (XLA, activations quantized to
# int8 per token: quantization="w8a8_int8"), and the Pallas kernel per backend.
MATMUL_IMPLS = ("reference", "xla_cpu", "w8a8", "pallas_tpu", "pallas_gpu", "pallas_interpret")
# xla_cpu: the widened chunk of a weight aims at this size (f32 bytes), and only products of at most
# this many rows are chunked (decode; more rows reuse a whole widened weight enough to pay for it).
CHUNK_BYTES = 256 * 1024
CHUNK_MAX_ROWS = 16
# A weight this many times wider than deep (a vocabulary head) is chunked along its output columns,
# in chunks of about this many widened bytes (fewer, larger chunks: each loop iteration costs a few
# microseconds of dispatch on XLA:CPU).
WIDE_RATIO = 16
COLUMN_CHUNK_BYTES = 1024 * 1024


@flax.struct.dataclass
class QuantArray:
    """A weight stored as int8 with f32 scales per group of input rows and output channel:
    w[k, n] ~= values[k, n] * scales[k // group_size, n] (group_size 0: scales[0, n], per channel).

    `kernel` is static and always "reference" outside a step; the step sets it from StepOptions
    (`with_kernel`) so that checkpoints, shardings and params share one tree structure.
    """

    values: jax.Array  # i8[..., in, out]
    scales: jax.Array  # f32[..., in // group_size or 1, out]
    group_size: int = flax.struct.field(pytree_node=False, default=0)
    kernel: str = flax.struct.field(pytree_node=False, default="reference")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


def check_group_size(k: int, group_size: int, what: str = "the weight") -> None:
    if group_size < 0 or (group_size and k % group_size):
        raise ValueError(
            f"quantization group size {group_size} must divide the input dimension {k} of {what} "
            "(or be 0: per output channel)"
        )


def quantize(w: jax.Array, group_size: int = 0) -> QuantArray:
    """Symmetric int8 of w f[..., in, out]: each group's (or, group_size 0, each channel's) absmax over
    `in` maps to 127."""
    *lead, k, n = w.shape
    check_group_size(k, group_size)
    g = group_size or k
    w32 = w.astype(jnp.float32).reshape(*lead, k // g, g, n)
    scales = jnp.max(jnp.abs(w32), axis=-2) / INT8_MAX  # f32[..., in // g, out]
    safe = jnp.where(scales > 0, scales, 1.0)  # an all-zero group stays zero
    values = jnp.clip(jnp.round(w32 / safe[..., None, :]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantArray(values=values.reshape(*lead, k, n), scales=scales, group_size=group_size)


def _widen(values: jax.Array, scales: jax.Array, dtype: Any) -> jax.Array:
    """values i8[..., R, N] times scales f32[..., R // G, N] (each scale row over G = R // rows(scales)
    consecutive rows), in `dtype`."""
    *lead, r, n = values.shape
    groups = scales.shape[-2]
    w = values.astype(jnp.float32).reshape(*lead, groups, r // groups, n) * scales[..., None, :]
    return w.reshape(*lead, r, n).astype(dtype)


def dequantize(q: QuantArray, dtype: Any = jnp.float32) -> jax.Array:
    return _widen(q.values, q.scales, dtype)


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
    if w.kernel == "w8a8":
        return _w8a8_matmul(x, w).astype(out_dtype)
    if w.kernel == "xla_cpu" and _decode_rows(x, w.values):
        return _chunked_int8(x, w).astype(out_dtype)
    if w.kernel in ("reference", "xla_cpu"):
        if w.group_size == 0:  # the convert is exact (|v| <= 127); the scale commutes with the k sum
            y = jnp.matmul(x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)
            return (y * w.scales[..., 0, :]).astype(out_dtype)
        return jnp.matmul(x, dequantize(w, x.dtype), preferred_element_type=jnp.float32).astype(out_dtype)
    return _pallas_matmul(x.astype(out_dtype), w).astype(out_dtype)


def _w8a8_matmul(x: jax.Array, w: QuantArray) -> jax.Array:
    """W8A8: x quantized per token (symmetric absmax over `in`, like a KV vector) and multiplied in int8
    with int32 accumulation, then scaled by the token's and the output channel's scales. Integer dots
    move a quarter of float32's operand bytes through the core; the activation rounding costs quality
    (docs/BENCHMARKS.md), so it is an option (activation_quantization="int8"), with per-channel
    weights: a group scale would split the integer dot into one per group."""
    if w.group_size:
        raise ValueError(
            "W8A8 multiplies int8 weights with one scale per output channel (group_size 0), "
            f"not groups of {w.group_size}"
        )
    sx = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True) / INT8_MAX  # f32[..., 1]
    xq = jnp.clip(jnp.round(x / jnp.where(sx > 0, sx, 1.0)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    y = jnp.matmul(xq, w.values, preferred_element_type=jnp.int32).astype(jnp.float32)
    return y * sx * w.scales[..., 0, :]


def _decode_rows(x: jax.Array, values: jax.Array) -> bool:
    """Whether x's rows times a weight of `values`' shape take the chunked xla_cpu path: one 2-D weight
    (not stacked experts) and few rows."""
    k = values.shape[-2]
    return values.ndim == 2 and x.size // x.shape[-1] <= CHUNK_MAX_ROWS and x.shape[-1] == k


def _chunked_int8(x: jax.Array, w: QuantArray) -> jax.Array:
    k, n = w.values.shape
    if n >= WIDE_RATIO * k:
        return _column_chunked(x, w.values, w.scales, _chunk_columns(k, n))
    rows = _chunk_rows(k, n, w.group_size)
    y = _row_chunked(x, w.values, w.scales if w.group_size else None, rows)
    return y * w.scales[0] if w.group_size == 0 else y


def _chunk_rows(k: int, n: int, group_size: int) -> int:
    """Input rows per chunk: a power of two dividing k, at least 8 and near CHUNK_BYTES widened; with
    groups, at most one group (a divisor of the group size, or the group itself)."""
    rows = 8
    while k % (2 * rows) == 0 and 2 * rows < k and 2 * rows * n * 4 <= CHUNK_BYTES:
        rows *= 2
    if group_size and group_size % rows:
        rows = group_size  # one group per chunk: its scales multiply the partial product (_row_chunked)
    return rows if k % rows == 0 else k


def _chunk_columns(k: int, n: int) -> int:
    """Output columns per chunk of a wide weight: a divisor of n, the widened [k, cols] near CHUNK_BYTES."""
    cols = max(1, COLUMN_CHUNK_BYTES // (4 * k))
    while n % cols:
        cols -= 1
    return cols


def _row_chunked(x: jax.Array, values: jax.Array, scales: jax.Array | None, rows: int) -> jax.Array:
    """f32 x [..., K] @ values i8[K, N] as a loop over chunks of `rows` input rows, each widened right
    before its partial product, so the widened weight stays in cache instead of a whole f32 copy of it
    being written to and read back from memory. With group `scales` f32[K // G, N] a chunk lies in one
    group (`_chunk_rows`), whose scale row multiplies the chunk's partial product."""
    k, n = values.shape
    chunks = values.reshape(k // rows, rows, n)
    xs = x.reshape(*x.shape[:-1], k // rows, rows)
    per_group = k if scales is None else k // scales.shape[0]
    assert per_group % rows == 0, (per_group, rows)

    def body(i, acc):
        xi = jax.lax.dynamic_index_in_dim(xs, i, axis=-2, keepdims=False)
        vi = jax.lax.dynamic_index_in_dim(chunks, i, axis=0, keepdims=False)
        y = jnp.matmul(xi, vi.astype(x.dtype), preferred_element_type=jnp.float32)
        if scales is not None:
            y = y * jax.lax.dynamic_index_in_dim(scales, i * rows // per_group, axis=0, keepdims=False)
        return acc + y

    return jax.lax.fori_loop(0, k // rows, body, jnp.zeros((*x.shape[:-1], n), jnp.float32))


def _column_chunked(x: jax.Array, values: jax.Array, scales: jax.Array, cols: int) -> jax.Array:
    """f32 x [..., K] @ (values i8[K, N] scaled by scales f32[K // G or 1, N]) as a loop over chunks of
    `cols` output columns: each chunk is read (a strided slice), widened and multiplied, and its
    columns of the result written once (a row loop would read and write a [rows, N] accumulator per
    chunk: for a vocabulary head that traffic exceeds the weight's)."""
    k, n = values.shape

    def body(i, out):
        vi = jax.lax.dynamic_slice_in_dim(values, i * cols, cols, axis=1)
        si = jax.lax.dynamic_slice_in_dim(scales, i * cols, cols, axis=1)
        if scales.shape[0] == 1:
            y = jnp.matmul(x, vi.astype(x.dtype), preferred_element_type=jnp.float32) * si[0]
        else:
            y = jnp.matmul(x, _widen(vi, si, x.dtype), preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(out, y, i * cols, axis=x.ndim - 1)

    return jax.lax.fori_loop(0, n // cols, body, jnp.zeros((*x.shape[:-1], n), jnp.float32))


def _pallas_matmul(x: jax.Array, w: QuantArray) -> jax.Array:
    from pallas_kernels import int8_matmul

    if w.kernel not in MATMUL_IMPLS:
        raise ValueError(f"unknown matmul implementation {w.kernel!r}; expected one of {MATMUL_IMPLS}")
    backend = "tpu" if w.kernel == "pallas_tpu" else "gpu"
    lead, k = x.shape[:-1], x.shape[-1]
    y = int8_matmul(
        x.reshape(-1, k),
        w.values,
        w.scales,
        group_size=w.group_size or k,
        backend=backend,
        interpret=w.kernel == "pallas_interpret",
    )
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


@flax.struct.dataclass
class Int4Array:
    """A weight stored as 4-bit codes, two per byte along `in`, with an f32 scale and bias per group of
    `group_size` input rows and output channel: w[k, n] = q[k, n] * scales[k // G, n] + biases[k // G, n].

    Row 2i is the low nibble of values[i], row 2i + 1 the high one (the layout of
    pallas_kernels/int4_matmul). `kernel` as QuantArray's.

    `perm` is for checkpoints whose groups are not runs of rows (GPTQ act-order: row k belongs to
    group g_idx[k]): the rows are stored sorted by group, stored row j being the weight's row perm[j],
    so w = stored[inverse perm] and x @ w = x[..., perm] @ stored. None is the identity."""

    values: jax.Array  # u8[..., in // 2, out]
    scales: jax.Array  # f32[..., in // group_size, out]
    biases: jax.Array  # f32[..., in // group_size, out]
    perm: jax.Array | None = None  # i32[..., in]: stored row j is the weight's row perm[j]; None = identity
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
    """The weight f[..., in, out] in its own row order (a `perm` undone)."""
    stored = _dequantize_stored(w, dtype)
    if w.perm is None:
        return stored
    inverse = jnp.argsort(w.perm, axis=-1)  # weight row k is stored row inverse[k]
    return jnp.take_along_axis(stored, inverse[..., :, None], axis=-2)


def _dequantize_stored(w: Int4Array, dtype: Any) -> jax.Array:
    """The stored rows f[..., in, out] dequantized, in stored order (sorted by group under a `perm`)."""
    even = _dequant_half(w.values & 0xF, w, w.scales, w.biases, dtype)
    odd = _dequant_half(w.values >> 4, w, w.scales, w.biases, dtype)
    *lead, half, n = w.values.shape
    return jnp.stack([even, odd], axis=-2).reshape(*lead, 2 * half, n)


def _permute_columns(x: jax.Array, perm: jax.Array) -> jax.Array:
    """x[..., perm]: a weight's perm i32[in] for every row of x; stacked perms i32[L, in] batch with x
    [L, ..., in] as matmul batches x with the stacked weight."""
    if perm.ndim == 1:
        return jnp.take(x, perm, axis=-1)
    index = perm.reshape(*perm.shape[:-1], *(1,) * (x.ndim - perm.ndim), perm.shape[-1])
    return jnp.take_along_axis(x, index, axis=-1)


def int4_matmul(x: jax.Array, w: Int4Array) -> jax.Array:
    """x f[..., in] @ w: f32[..., out]. Decode rows on one device ("xla_cpu") stream the packed bytes
    in chunks (`_int4_chunked`); the Pallas kernels (`pallas_kernels.int4_matmul`) unpack in-register
    on TPU and GPU; everything else (prefill on a CPU, the XLA reference) dequantizes the weight in
    x's dtype and multiplies. A `perm` gathers x's columns into the stored row order first (on a mesh
    that splits `in`, GSPMD gathers across the shards: see docs on act-order)."""
    if w.perm is not None:
        x, w = _permute_columns(x, w.perm), w.replace(perm=None)
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
    y = kernel(
        x.reshape(-1, k),
        w.values,
        w.scales,
        w.biases,
        group_size=w.group_size,
        backend=backend,
        interpret=w.kernel == "pallas_interpret",
    )
    return y.reshape(*lead, w.values.shape[-1]).astype(jnp.float32)


def _int4_chunk_rows(x: jax.Array, w: Int4Array) -> int:
    """Packed rows per chunk of the CPU decode path: one group (0 = not chunked: stacked experts or
    more than CHUNK_MAX_ROWS rows)."""
    kp = w.values.shape[-2]
    if w.values.ndim != 2 or x.size // (2 * kp) > CHUNK_MAX_ROWS:
        return 0
    return w.group_size // 2


def _int4_chunked(x: jax.Array, w: Int4Array, rows: int) -> jax.Array:
    """x @ w as a loop over groups (`rows` packed rows each): a group's low and high nibbles are widened
    right before their partial products with x's even and odd columns, and since w = q s + b within the
    group, x_g . w_g = s (x_g . q_g) + b sum(x_g): no per-element scaling, and neither the nibbles nor
    the widened weight are ever interleaved or written out whole."""
    kp, n = w.values.shape
    steps = kp // rows
    lead = x.shape[:-1]
    xs = x.reshape(*lead, steps, rows, 2)  # [..., group, packed row, even/odd]
    values = w.values.reshape(steps, rows, n)

    def body(i, acc):
        xi = jax.lax.dynamic_index_in_dim(xs, i, axis=-3, keepdims=False)  # [..., rows, 2]
        v = jax.lax.dynamic_index_in_dim(values, i, axis=0, keepdims=False)
        s = jax.lax.dynamic_index_in_dim(w.scales, i, axis=0, keepdims=False)
        b = jax.lax.dynamic_index_in_dim(w.biases, i, axis=0, keepdims=False)
        p = jnp.matmul(xi[..., 0], (v & 0xF).astype(x.dtype), preferred_element_type=jnp.float32)
        p = p + jnp.matmul(xi[..., 1], (v >> 4).astype(x.dtype), preferred_element_type=jnp.float32)
        return acc + p * s + jnp.sum(xi, axis=(-2, -1), dtype=jnp.float32)[..., None] * b

    return jax.lax.fori_loop(0, steps, body, jnp.zeros((*lead, n), jnp.float32))


# ---- the quantized params layout ----------------------------------------------------------------
def quantized_fields(quantization: str) -> tuple[str, ...]:
    """The LayerParams fields `quantization` replaces: every linear weight, experts included."""
    return LINEAR_FIELDS if quantization in ("int8", "int4") else ()


def map_linear(
    params: Params, fn: Callable[[Any], Any], quantize_lm_head: bool = False, fields: tuple[str, ...] = LINEAR_FIELDS
) -> Params:
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
        scales = jnp.moveaxis(jnp.take(table.scales, tokens, axis=-1), 0, -1)  # f32[..., D // G or 1]
        groups = values.reshape(*tokens.shape, scales.shape[-1], -1).astype(jnp.float32)
        return (groups * scales[..., None]).reshape(values.shape).astype(dtype)
    packed = jnp.moveaxis(jnp.take(table.values, tokens, axis=-1), 0, -1)  # u8[..., D // 2]
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1)  # u8[..., D // 2, 2]
    scales = jnp.moveaxis(jnp.take(table.scales, tokens, axis=-1), 0, -1)  # f32[..., D // G]
    biases = jnp.moveaxis(jnp.take(table.biases, tokens, axis=-1), 0, -1)
    groups = codes.reshape(*tokens.shape, scales.shape[-1], table.group_size).astype(jnp.float32)
    rows = groups * scales[..., None] + biases[..., None]
    return rows.reshape(*tokens.shape, -1).astype(dtype)


def quantized_axes(axes: tuple[str | None, ...], group_size: int = 0) -> QuantArray:
    """Logical axes of an int8 weight: values keep the weight's; group scales too (a device holding some
    input rows holds their groups' scales), per-channel scales' one row is on every device."""
    scales = axes if group_size else axes[:-2] + (None,) + axes[-1:]
    return QuantArray(values=axes, scales=scales, group_size=group_size)


def int4_axes(axes: tuple[str | None, ...], permuted: bool = False, group_size: int = INT4_GROUP_SIZE) -> Int4Array:
    """Logical axes of an int4 weight: packed values and per-group scales and biases keep the weight's
    (a device holding some input rows holds their bytes and their groups'); a `perm` (`permuted`)
    follows the `in` axis, so a device holds the indices of its stored rows."""
    return Int4Array(values=axes, scales=axes, biases=axes, perm=axes[:-1] if permuted else None, group_size=group_size)


def _per_field(quantization: str, group_size: int | None) -> tuple[Callable, Callable]:
    """(quantize, axes) functions of `quantization` for the dense weights and the head, and for int4
    experts too (groups along each expert's `in`); int8 experts keep one scale per expert and output
    channel instead (model.moe multiplies them itself)."""
    g = quantization_group_size(quantization, group_size)
    if quantization == "int4":
        return (lambda w: quantize_int4(w, g)), (lambda a: int4_axes(a, group_size=g))
    return (lambda w: quantize(w, g)), (lambda a: quantized_axes(a, g))


def quantized_layout(
    params: Params, quantization: str, quantize_lm_head: bool = False, group_size: int | None = None
) -> Params:
    """A Params-shaped tree of logical axes in the layout of `quantization` ("none" leaves it)."""
    if quantization not in ("int8", "int4"):
        return params
    axes_fn = _per_field(quantization, group_size)[1]
    axes = map_linear(params, axes_fn, quantize_lm_head, DENSE_FIELDS)
    return map_linear(axes, quantized_axes if quantization == "int8" else axes_fn, fields=EXPERT_FIELDS)


def quantize_params(
    params: Params, quantize_lm_head: bool = False, quantization: str = "int8", group_size: int | None = None
) -> Params:
    """The params with their linear weights quantized; group_size None: the largest default that divides
    every quantized weight's input rows (config.default_group_size's rule on one device)."""
    if group_size is None:
        layer = params.layers[0] if isinstance(params.layers, tuple) else params.layers
        grouped = LINEAR_FIELDS if quantization == "int4" else DENSE_FIELDS  # int8 experts: per channel
        group_size = group_size_fitting(
            quantization, (getattr(layer, f).shape[-2] for f in grouped if getattr(layer, f) is not None)
        )
    dense_fn = _per_field(quantization, group_size)[0]
    q = map_linear(params, dense_fn, quantize_lm_head, DENSE_FIELDS)
    return map_linear(q, quantize if quantization == "int8" else dense_fn, fields=EXPERT_FIELDS)


def quantize_params_placed(
    params: Params,
    shardings: Params,
    quantize_lm_head: bool = False,
    quantization: str = "int8",
    group_size: int | None = None,
) -> Params:
    """Quantize params already on their devices, one weight at a time, each result on its sharding.

    Consumes `params`: each float weight is deleted as soon as its int8 form exists, so device memory
    peaks near the float model plus one weight, never two float copies. `shardings` is the quantized
    layout (`sharding.make_shardings(..., quantization=quantization)`)."""
    jitted: dict[Any, Callable] = {}
    dense_fn = _per_field(quantization, group_size)[0]

    def quantize_one(w: jax.Array, sharding: Any, transpose: bool, expert: bool) -> Any:
        key = (sharding, transpose, expert)
        if key not in jitted:
            fn = quantize if expert else dense_fn  # int4 experts are marked "dense": groups like dense
            jitted[key] = jax.jit(lambda w: fn(w.T if transpose else w), out_shardings=sharding)
        q = jitted[key](w)
        w.delete()  # the runtime frees it once the quantize that reads it is done
        return q

    marks = map_linear(jax.tree.map(lambda _: "", params), lambda _: "dense", quantize_lm_head, DENSE_FIELDS)
    marks = map_linear(marks, lambda _: "expert" if quantization == "int8" else "dense", fields=EXPERT_FIELDS)
    leaves, treedef = jax.tree.flatten(params)
    targets = jax.tree.leaves(shardings, is_leaf=is_quant)
    tied = quantize_lm_head and params.lm_head is None
    out = [
        quantize_one(w, sh, tied and w is params.embed, mark == "expert") if mark else w
        for w, mark, sh in zip(leaves, jax.tree.leaves(marks), targets)
    ]
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
