"""int8 weight-only matmul for GPUs (Pallas Triton): int8 tiles widened in registers, f32 accumulation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.int8_matmul.blocks import pad_to_blocks


def _kernel(
    x_ref,  # [bm, kp] row block of x (whole padded k)
    w_ref,  # i8[kp, bn] column block of w_q
    s_ref,  # f32[bn]
    o_ref,  # [bm, bn]
    *,
    bk: int,
):
    bm, kp = x_ref.shape
    bn = w_ref.shape[1]

    def body(kk, acc):
        x = x_ref[:, pl.ds(kk * bk, bk)]
        # Widen the int8 tile to x's dtype right before the dot (exact for |w| <= 127).
        w = w_ref[pl.ds(kk * bk, bk), :].astype(x.dtype)
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, kp // bk, body, jnp.zeros((bm, bn), jnp.float32))
    # The per-column scale commutes with the k reduction: apply it once.
    o_ref[...] = (acc * s_ref[...][None, :]).astype(o_ref.dtype)


def int8_matmul_gpu(
    x,  # [m, k]
    w_q,  # i8[k, n]
    w_scale,  # f32[n]
    *,
    blocks: tuple[int, int, int],
    interpret: bool,
):
    m, n = x.shape[0], w_q.shape[1]
    bm, bn, bk = blocks
    xp, wp, sp, (mp, np_, kp) = pad_to_blocks(x, w_q, w_scale, blocks)
    out = pl.pallas_call(
        functools.partial(_kernel, bk=bk),
        grid=(mp // bm, np_ // bn),
        in_specs=[
            pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((kp, bn), lambda i, j: (0, j)),
            pl.BlockSpec((bn,), lambda i, j: (j,)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="int8_matmul_gpu",
    )(xp, wp, sp)
    return out[:m, :n]
