"""int8 weight-only matmul: x [m, k] (f32/bf16) @ (w_q i8[k, n] * w_scale f32[k // group_size, n]) -> [m, n] in x's dtype."""

# Weight tiles stay int8 in HBM (half the bytes of bf16) and are widened tile by
# tile inside the kernel; products accumulate in f32. A scale per group of
# `group_size` input rows keeps quality on real weights: w[k, n] =
# w_q[k, n] * w_scale[k // G, n]. How a K block meets the scales
# (`blocks.scale_mode`): per column (G = k) the scale is applied once to the f32
# accumulator at the end; a block inside one group scales its f32 partial
# product by that group's row; a block spanning several groups dequantizes its
# weight tile before the dot. Block sizes come from
# `pallas_kernels.int8_matmul.blocks.TABLE` (initial guesses until tuned on
# hardware) unless block_m/block_n/block_k are given.

from __future__ import annotations

import functools

import jax

from pallas_kernels._common import resolve_backend
from pallas_kernels.int8_matmul.blocks import pick_blocks
from pallas_kernels.int8_matmul.reference import (
    dequantize_int8,
    group_scales,
    reference_int8_matmul,
    validate_int8_matmul,
)

__all__ = ["dequantize_int8", "int8_matmul", "reference_int8_matmul"]


@functools.partial(jax.jit, static_argnames=("group_size", "backend", "interpret", "block_m", "block_n", "block_k"))
def _int8_matmul_jit(x, w_q, w_scale, *, group_size, backend, interpret, block_m, block_n, block_k):
    m, k, n, g = validate_int8_matmul(
        x, w_q, w_scale, group_size=group_size, backend=backend, block_m=block_m, block_n=block_n, block_k=block_k
    )
    blocks = pick_blocks(backend, m, k, n, x.dtype, g, block_m, block_n, block_k)
    if backend == "tpu":
        from pallas_kernels.int8_matmul.tpu import int8_matmul_tpu as impl
    else:
        from pallas_kernels.int8_matmul.gpu import int8_matmul_gpu as impl
    return impl(x, w_q, group_scales(w_scale, group_size), group_size=g, blocks=blocks, interpret=interpret)


def int8_matmul(
    x,  # [m, k] f32/bf16/f16
    w_q,  # i8[k, n]
    w_scale,  # f32[k // group_size, n], or f32[n] (one scale per output column) when group_size is None
    *,
    group_size: int | None = None,
    backend: str | None = None,  # "tpu" | "gpu" | None (from jax.default_backend())
    interpret: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
):
    """Returns x @ w, w[k, n] = w_q[k, n] * w_scale[k // group_size, n], as [m, n] in x's dtype.

    Accumulated in f32. group_size = k (w_scale [1, n]) is per-column scaling; group_size=None takes
    per-column scales as f32[n]. On TPU group_size must be a multiple of 8 (or k), on GPU a power of two
    (or k). Block sizes default to `blocks.TABLE` (initial guesses, untuned); a given block_k must be a
    multiple of group_size or divide it. On CPU pass backend="tpu" or "gpu" with interpret=True (or call
    reference_int8_matmul).
    """
    backend = resolve_backend(backend, interpret, fn_name="int8_matmul")
    return _int8_matmul_jit(
        x,
        w_q,
        w_scale,
        group_size=group_size,
        backend=backend,
        interpret=bool(interpret),
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
    )
