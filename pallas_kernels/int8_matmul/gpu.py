"""int8 weight-only matmul for GPUs (Pallas Triton): int8 tiles widened (and, per group, scaled) in registers, f32 accumulation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.int8_matmul.blocks import BLOCK, COLUMN, TILE, pad_to_blocks, scale_mode


def _kernel(
    x_ref,  # [bm, kp] row block of x (whole padded k)
    w_ref,  # i8[kp, bn] column block of w_q
    s_ref,  # f32[1, bn] (COLUMN) or f32[kp // G, bn]
    o_ref,  # [bm, bn]
    *,
    bk: int,
    mode: str,
    group_size: int,
):
    bm, kp = x_ref.shape
    bn = w_ref.shape[1]

    def body(kk, acc):
        x = x_ref[:, pl.ds(kk * bk, bk)]
        w = w_ref[pl.ds(kk * bk, bk), :]
        if mode == TILE:
            # bk // G groups: widen to f32, scale each group's rows by its scale row, round to x's dtype.
            ng = bk // group_size
            s = s_ref[pl.ds(kk * ng, ng), :]
            w = (w.astype(jnp.float32).reshape(ng, group_size, bn) * s[:, None, :]).reshape(bk, bn)
        # Widening the int8 tile to x's dtype is exact for |w| <= 127.
        part = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
        if mode == BLOCK:
            # The block lies in one group: its scale row commutes with the block's k sum.
            part = part * s_ref[pl.ds(lax.div(kk, group_size // bk), 1), :]
        return acc + part

    acc = lax.fori_loop(0, kp // bk, body, jnp.zeros((bm, bn), jnp.float32))
    if mode == COLUMN:
        # The per-column scale commutes with the whole k reduction: apply it once.
        acc = acc * s_ref[...]
    o_ref[...] = acc.astype(o_ref.dtype)


def int8_matmul_gpu(
    x,  # [m, k]
    w_q,  # i8[k, n]
    scales,  # f32[k // G, n] (f32[1, n] when G = k)
    *,
    group_size: int,
    blocks: tuple[int, int, int],
    interpret: bool,
):
    m, k = x.shape
    n = w_q.shape[1]
    bm, bn, bk = blocks
    mode = scale_mode(k, group_size, bk)
    xp, wp, sp, (mp, np_, kp) = pad_to_blocks(x, w_q, scales, group_size, blocks)
    out = pl.pallas_call(
        functools.partial(_kernel, bk=bk, mode=mode, group_size=group_size),
        grid=(mp // bm, np_ // bn),
        in_specs=[
            pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((kp, bn), lambda i, j: (0, j)),
            pl.BlockSpec((sp.shape[0], bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="int8_matmul_gpu",
    )(xp, wp, sp)
    return out[:m, :n]
