"""Plain-JAX int4 weight-only matmul (packed nibbles, per-group scale and bias) and the input checks shared with the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_float_dtype, check_matmul_blocks, is_pow2

FN = "int4_matmul"


def validate_int4_matmul(
    x,  # [m, k]
    values,  # u8[k // 2, n]
    scales,  # f32[k // group_size, n]
    biases,  # f32[k // group_size, n]
    *,
    group_size: int,
    backend: str | None,
    block_m: int | None,
    block_n: int | None,
    block_k: int | None,
) -> tuple[int, int, int]:
    """Returns (m, k, n); raises ValueError on a bad shape, dtype, group size or block size."""
    if x.ndim != 2:
        raise ValueError(f"{FN}: x must be [m, k], got shape {x.shape}.")
    check_float_dtype("x", x, FN)
    if values.ndim != 2:
        raise ValueError(f"{FN}: values must be [k // 2, n] (two 4-bit codes per byte), got shape {values.shape}.")
    if jnp.dtype(values.dtype) != jnp.dtype(jnp.uint8):
        raise ValueError(f"{FN}: values must be uint8 (packed nibbles), got {values.dtype}.")
    m, k = x.shape
    half, n = values.shape
    if 2 * half != k:
        raise ValueError(
            f"{FN}: x is [{m}, {k}] but values is [{half}, {n}]; values must have k // 2 = "
            f"{k / 2:g} rows (two 4-bit codes per byte along k)."
        )
    if min(m, k, n) < 1:
        raise ValueError(f"{FN}: empty operands are not supported (m={m}, k={k}, n={n}).")
    g = group_size
    if not isinstance(g, int) or g < 2 or g % 2:
        raise ValueError(f"{FN}: group_size must be a positive even int, got {g!r}.")
    if k % g:
        raise ValueError(f"{FN}: group_size {g} must divide k = {k}.")
    for name, a in (("scales", scales), ("biases", biases)):
        if a.shape != (k // g, n):
            raise ValueError(f"{FN}: {name} must have shape ({k // g}, {n}) (k // group_size, n), got {a.shape}.")
        if jnp.dtype(a.dtype) != jnp.dtype(jnp.float32):
            raise ValueError(f"{FN}: {name} must be float32, got {a.dtype}.")
    check_matmul_blocks(FN, backend, x.dtype, block_m=block_m, block_n=block_n, block_k=block_k)
    if backend == "tpu":
        # Groups are dequantized as static 8-row-aligned slices of the f32 nibble tile.
        if g % 16:
            raise ValueError(f"{FN}: on TPU group_size must be a multiple of 16, got {g}.")
        if block_n is not None and block_n % 128 and block_n != n:
            raise ValueError(f"{FN}: on TPU block_n must be a multiple of 128 (lane width) or n, got {block_n}.")
        if block_k is not None and block_k != k and (block_k % 256 or block_k % (8 * g)):
            raise ValueError(
                f"{FN}: on TPU block_k must be k or a multiple of 256 and of 8 * group_size "
                f"(= {8 * g}: whole 8-row tiles of scales), got {block_k}."
            )
    elif backend == "gpu":
        if not is_pow2(g) or g < 16:
            raise ValueError(f"{FN}: on GPU group_size must be a power of two >= 16 (Triton), got {g}.")
        if block_k is not None and (block_k < g or block_k < 32):
            raise ValueError(
                f"{FN}: on GPU block_k must be >= group_size and >= 32 (whole groups, a 16-row "
                f"dot per nibble half), got {block_k}."
            )
    return m, k, n


def dequantize_int4(
    values,  # u8[k // 2, n]
    scales,  # f32[k // group_size, n]
    biases,  # f32[k // group_size, n]
    group_size: int,
):  # -> f32[k, n]
    """w[k, n] = q[k, n] * scales[k // G, n] + biases[k // G, n]; q of row 2i is values[i]'s low nibble, 2i+1 high."""
    half, n = values.shape
    q = jnp.stack([values & 0xF, values >> 4], axis=1).reshape(2 * half, n).astype(jnp.float32)
    s = jnp.repeat(scales, group_size, axis=0)
    b = jnp.repeat(biases, group_size, axis=0)
    return q * s + b


def reference_int4_matmul(
    x,  # [m, k] f32/bf16/f16
    values,  # u8[k // 2, n]
    scales,  # f32[k // group_size, n]
    biases,  # f32[k // group_size, n]
    *,
    group_size: int,
    backend: str | None = None,
    interpret: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
):
    """x @ dequantize(values, scales, biases) in f32, returned in x's dtype (tuning args ignored)."""
    del backend, interpret
    validate_int4_matmul(
        x,
        values,
        scales,
        biases,
        group_size=group_size,
        backend=None,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
    )
    w = dequantize_int4(values, scales, biases, group_size)
    acc = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return acc.astype(x.dtype)
