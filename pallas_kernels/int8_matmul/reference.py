"""Plain-JAX int8 weight-only matmul and the input checks shared with the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_float_dtype, check_matmul_blocks

FN = "int8_matmul"


def validate_int8_matmul(
    x,  # [m, k]
    w_q,  # i8[k, n]
    w_scale,  # f32[n]
    *,
    backend: str | None,
    block_m: int | None,
    block_n: int | None,
    block_k: int | None,
) -> tuple[int, int, int]:
    """Returns (m, k, n); raises ValueError on a bad shape, dtype or block size."""
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
    if w_scale.shape != (n,):
        raise ValueError(f"{FN}: w_scale must have shape ({n},) (one scale per output column), got {w_scale.shape}.")
    if jnp.dtype(w_scale.dtype) != jnp.dtype(jnp.float32):
        raise ValueError(f"{FN}: w_scale must be float32, got {w_scale.dtype}.")
    if min(m, k, n) < 1:
        raise ValueError(f"{FN}: empty operands are not supported (m={m}, k={k}, n={n}).")
    check_matmul_blocks(FN, backend, x.dtype, block_m=block_m, block_n=block_n, block_k=block_k)
    if backend == "tpu":
        for name, b in (("block_n", block_n), ("block_k", block_k)):
            if b is not None and b % 128:
                raise ValueError(f"{FN}: on TPU {name} must be a multiple of 128 (lane width), got {b}.")
    return m, k, n


def reference_int8_matmul(
    x,  # [m, k] f32/bf16/f16
    w_q,  # i8[k, n]
    w_scale,  # f32[n]
    *,
    backend: str | None = None,
    interpret: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
):
    """x @ (w_q * w_scale) accumulated in f32, returned in x's dtype (tuning args ignored)."""
    del backend, interpret
    validate_int8_matmul(x, w_q, w_scale, backend=None, block_m=block_m, block_n=block_n, block_k=block_k)
    acc = jnp.dot(x.astype(jnp.float32), w_q.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return (acc * w_scale[None, :]).astype(x.dtype)
