"""int4 weight-only matmul: x [m, k] (f32/bf16) @ (q u4[k, n] * scales + biases per group of k rows) -> [m, n] in x's dtype."""

# The weight stays packed in HBM, two 4-bit codes per byte along k (row 2i in
# the low nibble, 2i + 1 in the high one; jaxserve.model.quant.Int4Array's
# layout), with an f32 scale and bias per group of `group_size` k rows and
# output column: w[k, n] = q[k, n] * scales[k // G, n] + biases[k // G, n].
# Only x is rearranged outside the kernels (its even and odd columns, which
# multiply the low and high nibbles), so the unpacked weight is never
# interleaved nor written to HBM: each packed tile is unpacked, scaled and
# biased in VMEM / registers right before its two dots, which accumulate in f32.
# Block sizes come from `pallas_kernels.int4_matmul.blocks.TABLE` (initial
# guesses until tuned on hardware) unless block_m/block_n/block_k are given.

from __future__ import annotations

import functools

import jax

from pallas_kernels._common import resolve_backend
from pallas_kernels.int4_matmul.blocks import pick_blocks
from pallas_kernels.int4_matmul.reference import dequantize_int4, reference_int4_matmul, validate_int4_matmul

__all__ = ["dequantize_int4", "int4_matmul", "reference_int4_matmul"]


@functools.partial(jax.jit, static_argnames=("group_size", "backend", "interpret", "block_m", "block_n", "block_k"))
def _int4_matmul_jit(x, values, scales, biases, *, group_size, backend, interpret, block_m, block_n, block_k):
    m, k, n = validate_int4_matmul(
        x,
        values,
        scales,
        biases,
        group_size=group_size,
        backend=backend,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
    )
    blocks = pick_blocks(backend, m, k, n, x.dtype, group_size, block_m, block_n, block_k)
    if backend == "tpu":
        from pallas_kernels.int4_matmul.tpu import int4_matmul_tpu as impl
    else:
        from pallas_kernels.int4_matmul.gpu import int4_matmul_gpu as impl
    return impl(x, values, scales, biases, group_size=group_size, blocks=blocks, interpret=interpret)


def int4_matmul(
    x,  # [m, k] f32/bf16/f16
    values,  # u8[k // 2, n]: row 2i of q in the low nibble, 2i + 1 in the high
    scales,  # f32[k // group_size, n]
    biases,  # f32[k // group_size, n]
    *,
    group_size: int,
    backend: str | None = None,  # "tpu" | "gpu" | None or "auto" (from jax.default_backend())
    interpret: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,  # in unpacked k: a block reads block_k // 2 packed rows
):
    """Returns x @ w, w[k, n] = q[k, n] * scales[k // G, n] + biases[k // G, n], as [m, n] in x's dtype.

    Accumulated in f32; for 16-bit x each dequantized weight tile is rounded to x's dtype before its dot.
    Block sizes default to `blocks.TABLE` (initial guesses, untuned); on CPU pass backend="tpu" or
    "gpu" with interpret=True (or call reference_int4_matmul).
    """
    backend = resolve_backend(None if backend == "auto" else backend, interpret, fn_name="int4_matmul")
    return _int4_matmul_jit(
        x,
        values,
        scales,
        biases,
        group_size=group_size,
        backend=backend,
        interpret=bool(interpret),
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
    )
