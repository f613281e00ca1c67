"""Plain-JAX int8 weight-only matmul (an f32 scale per group of input rows) and the input checks shared with the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_float_dtype, check_matmul_blocks, is_pow2

FN = "int8_matmul"


def validate_int8_matmul(
    x,  # [m, k]
    w_q,  # i8[k, n]
    w_scale,  # f32[k // group_size, n], or f32[n] when group_size is None
    *,
    group_size: int | None,
    backend: str | None,
    block_m: int | None,
    block_n: int | None,
    block_k: int | None,
) -> tuple[int, int, int, int]:
    """Returns (m, k, n, group_size), group_size = k for per-column scales; raises ValueError on a bad shape,
    dtype, group size or block size."""
    if x.ndim != 2:
        raise ValueError(f"{FN}: x must be [m, k], got shape {x.shape}.")
    check_float_dtype("x", x, FN)
    if w_q.ndim != 2:
        raise ValueError(f"{FN}: w_q must be [k, n], got shape {w_q.shape}.")
    if jnp.dtype(w_q.dtype) != jnp.dtype(jnp.int8):
        raise ValueError(f"{FN}: w_q must be int8, got {w_q.dtype}.")
    m, k = x.shape
    k_w, n = w_q.shape
    if k_w != k:
        raise ValueError(f"{FN}: x is [{m}, {k}] but w_q is [{k_w}, {n}]; the k dims must match.")
    if min(m, k, n) < 1:
        raise ValueError(f"{FN}: empty operands are not supported (m={m}, k={k}, n={n}).")
    if group_size is None:
        if w_scale.shape != (n,):
            raise ValueError(
                f"{FN}: without group_size, w_scale must have shape ({n},) (one scale per output "
                f"column), got {w_scale.shape}."
            )
        g = k
    else:
        g = group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"{FN}: group_size must be a positive int, got {g!r}.")
        if k % g:
            raise ValueError(f"{FN}: group_size {g} must divide k = {k}.")
        if w_scale.shape != (k // g, n):
            raise ValueError(
                f"{FN}: w_scale must have shape ({k // g}, {n}) (k // group_size, n), got {w_scale.shape}."
            )
    if jnp.dtype(w_scale.dtype) != jnp.dtype(jnp.float32):
        raise ValueError(f"{FN}: w_scale must be float32, got {w_scale.dtype}.")
    check_matmul_blocks(FN, backend, x.dtype, block_m=block_m, block_n=block_n, block_k=block_k)
    grouped = g < k
    if grouped and block_k is not None and block_k % g and g % block_k:
        raise ValueError(
            f"{FN}: block_k must be a multiple of group_size or divide it (a K block spans whole "
            f"groups or lies in one), got block_k={block_k}, group_size={g}."
        )
    if backend == "tpu":
        if block_n is not None and block_n % 128 and block_n != n:
            raise ValueError(f"{FN}: on TPU block_n must be a multiple of 128 (lane width) or n, got {block_n}.")
        if block_k is not None and block_k % 128 and block_k != k:
            raise ValueError(f"{FN}: on TPU block_k must be a multiple of 128 (lane width) or k, got {block_k}.")
        if grouped and g % 8:
            # A K block's groups are dequantized as static slices of its f32 weight tile: 8-row aligned.
            raise ValueError(f"{FN}: on TPU group_size must be a multiple of 8 (or k), got {g}.")
    elif backend == "gpu" and grouped and not is_pow2(g):
        raise ValueError(f"{FN}: on GPU group_size must be a power of two (or k: Triton tiles), got {g}.")
    return m, k, n, g


def group_scales(
    w_scale,  # f32[k // group_size, n], or f32[n] when group_size is None
    group_size: int | None,
):  # -> f32[k // G, n]
    """The scales as [groups, n]: per-column scales [n] are the one-group case [1, n]."""
    return w_scale[None, :] if group_size is None else w_scale


def dequantize_int8(
    w_q,  # i8[k, n]
    scales,  # f32[k // group_size, n]
    group_size: int,
):  # -> f32[k, n]
    """w[k, n] = w_q[k, n] * scales[k // G, n]."""
    return w_q.astype(jnp.float32) * jnp.repeat(scales, group_size, axis=0)


def reference_int8_matmul(
    x,  # [m, k] f32/bf16/f16
    w_q,  # i8[k, n]
    w_scale,  # f32[k // group_size, n], or f32[n] (one scale per output column) when group_size is None
    *,
    group_size: int | None = None,
    backend: str | None = None,
    interpret: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
):
    """x @ dequantize(w_q, w_scale) in f32, returned in x's dtype (tuning args ignored)."""
    del backend, interpret
    _, _, _, g = validate_int8_matmul(
        x, w_q, w_scale, group_size=group_size, backend=None, block_m=block_m, block_n=block_n, block_k=block_k
    )
    w = dequantize_int8(w_q, group_scales(w_scale, group_size), g)
    acc = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return acc.astype(x.dtype)
