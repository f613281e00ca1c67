"""int4 weight-only matmul for GPUs (Pallas Triton): packed nibble tiles unpacked and dequantized in registers, f32 accumulation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.int4_matmul.blocks import pad_to_blocks


def _dequant(
    q,  # f32[bk // 2, bn] codes of one nibble half
    s,  # f32[ng, bn]
    b,  # f32[ng, bn]
    dtype,
):  # -> [bk // 2, bn] dtype
    ng, bn = s.shape
    rows = q.shape[0]
    w = q.reshape(ng, rows // ng, bn) * s[:, None, :] + b[:, None, :]
    return w.reshape(rows, bn).astype(dtype)


def _kernel(
    xlo_ref,  # [bm, kp // 2] x's even columns (multiply the low nibbles)
    xhi_ref,  # [bm, kp // 2] x's odd columns (multiply the high nibbles)
    v_ref,  # u8[kp // 2, bn] packed codes of a column block
    s_ref,  # f32[kp // G, bn]
    b_ref,  # f32[kp // G, bn]
    o_ref,  # [bm, bn]
    *,
    bk: int,
    group_size: int,
):
    bm, hkp = xlo_ref.shape
    bn = v_ref.shape[1]
    hk, ng = bk // 2, bk // group_size

    def body(kk, acc):
        x_lo = xlo_ref[:, pl.ds(kk * hk, hk)]
        x_hi = xhi_ref[:, pl.ds(kk * hk, hk)]
        p = v_ref[pl.ds(kk * hk, hk), :].astype(jnp.int32)  # the only weight bytes read: u8
        s = s_ref[pl.ds(kk * ng, ng), :]
        b = b_ref[pl.ds(kk * ng, ng), :]
        lo = _dequant((p & 0xF).astype(jnp.float32), s, b, x_lo.dtype)
        hi = _dequant((p >> 4).astype(jnp.float32), s, b, x_lo.dtype)
        acc = acc + jnp.dot(x_lo, lo, preferred_element_type=jnp.float32)
        return acc + jnp.dot(x_hi, hi, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, hkp // hk, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def int4_matmul_gpu(
    x,  # [m, k]
    values,  # u8[k // 2, n]
    scales,  # f32[k // G, n]
    biases,  # f32[k // G, n]
    *,
    group_size: int,
    blocks: tuple[int, int, int],
    interpret: bool,
):
    m, n = x.shape[0], values.shape[1]
    bm, bn, bk = blocks
    x_lo, x_hi, vp, sp, bp, (mp, np_, kp) = pad_to_blocks(x, values, scales, biases, group_size, blocks)
    hkp, ngp = kp // 2, kp // group_size
    out = pl.pallas_call(
        functools.partial(_kernel, bk=bk, group_size=group_size),
        grid=(mp // bm, np_ // bn),
        in_specs=[
            pl.BlockSpec((bm, hkp), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, hkp), lambda i, j: (i, 0)),
            pl.BlockSpec((hkp, bn), lambda i, j: (0, j)),
            pl.BlockSpec((ngp, bn), lambda i, j: (0, j)),
            pl.BlockSpec((ngp, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="int4_matmul_gpu",
    )(x_lo, x_hi, vp, sp, bp)
    return out[:m, :n]
