"""int8 weight-only matmul: x [m, k] (f32/bf16) @ (w_q i8[k, n] * w_scale f32[n]) -> [m, n] in x's dtype."""

# Weight tiles stay int8 in HBM (half the bytes of bf16) and are widened tile by
# tile inside the kernel; products accumulate in f32 and the per-output-column
# scale is applied once to the f32 accumulator (it commutes with the k sum).
# Block sizes come from `pallas_kernels.int8_matmul.blocks.TABLE` (initial
# guesses until tuned on hardware) unless block_m/block_n/block_k are given.

from __future__ import annotations

import functools

import jax

from pallas_kernels._common import resolve_backend
from pallas_kernels.int8_matmul.blocks import pick_blocks
from pallas_kernels.int8_matmul.reference import reference_int8_matmul, validate_int8_matmul

__all__ = ["int8_matmul", "reference_int8_matmul"]


@functools.partial(jax.jit, static_argnames=("backend", "interpret", "block_m", "block_n", "block_k"))
def _int8_matmul_jit(x, w_q, w_scale, *, backend, interpret, block_m, block_n, block_k):
    m, k, n = validate_int8_matmul(x, w_q, w_scale, backend=backend, block_m=block_m, block_n=block_n,
                                   block_k=block_k)
    blocks = pick_blocks(backend, m, k, n, x.dtype, block_m, block_n, block_k)
    if backend == "tpu":
        from pallas_kernels.int8_matmul.tpu import int8_matmul_tpu as impl
    else:
        from pallas_kernels.int8_matmul.gpu import int8_matmul_gpu as impl
    return impl(x, w_q, w_scale, blocks=blocks, interpret=interpret)


def int8_matmul(
    x,  # [m, k] f32/bf16/f16
    w_q,  # i8[k, n]
    w_scale,  # f32[n]
    *,
    backend: str | None = None,  # "tpu" | "gpu" | None (from jax.default_backend())
    interpret: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
):
    """Returns x @ (w_q * w_scale[None, :]) as [m, n] in x's dtype, accumulated in f32.

    Block sizes default to `blocks.TABLE` (initial guesses, untuned); on CPU pass
    backend="tpu" or "gpu" with interpret=True (or call reference_int8_matmul).
    """
    backend = resolve_backend(backend, interpret, fn_name="int8_matmul")
    return _int8_matmul_jit(x, w_q, w_scale, backend=backend, interpret=bool(interpret), block_m=block_m,
                            block_n=block_n, block_k=block_k)
