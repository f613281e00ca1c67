"""int4 weight-only matmul for TPUs (Mosaic): packed nibble tiles are unpacked and dequantized in VMEM, f32 accumulation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import tpu_interpret_arg
from pallas_kernels.int4_matmul.blocks import pad_to_blocks


def _dequant(
    q,  # f32[bk // 2, bn] codes of one nibble half
    s,  # f32[ng, bn]
    b,  # f32[ng, bn]
    half: int,  # packed rows per group: group_size // 2
    dtype,
):  # -> [bk // 2, bn] dtype
    # One static, 8-row-aligned slice per group, its scale and bias row broadcast over the sublanes:
    # plain vector ops, no relayout (a [ng, half, bn] reshape would need one per group anyway).
    parts = [q[g * half : (g + 1) * half] * s[g : g + 1] + b[g : g + 1] for g in range(s.shape[0])]
    w = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
    return w.astype(dtype)


def _kernel(
    xlo_ref,  # VMEM [bm, bk // 2] x's even columns (multiply the low nibbles)
    xhi_ref,  # VMEM [bm, bk // 2] x's odd columns (multiply the high nibbles)
    v_ref,  # VMEM u8[bk // 2, bn] packed codes
    s_ref,  # VMEM f32[bk // G, bn]
    b_ref,  # VMEM f32[bk // G, bn]
    o_ref,  # VMEM [bm, bn] x's dtype
    acc_ref,  # VMEM f32[bm, bn]
    *,
    half: int,
):
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    x_lo, x_hi = xlo_ref[...], xhi_ref[...]
    # Bit operations in int32 (u8 vector ops are not native on every TPU generation); codes are 0..255.
    p = v_ref[...].astype(jnp.int32)
    s, b = s_ref[...], b_ref[...]
    lo = _dequant((p & 0xF).astype(jnp.float32), s, b, half, x_lo.dtype)
    hi = _dequant((p >> 4).astype(jnp.float32), s, b, half, x_lo.dtype)
    precision = lax.Precision.HIGHEST if x_lo.dtype == jnp.float32 else None
    acc_ref[...] += jnp.dot(x_lo, lo, preferred_element_type=jnp.float32, precision=precision) + jnp.dot(
        x_hi, hi, preferred_element_type=jnp.float32, precision=precision
    )

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def int4_matmul_tpu(
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
    hk, ng = bk // 2, bk // group_size
    out = pl.pallas_call(
        functools.partial(_kernel, half=group_size // 2),
        grid=(mp // bm, np_ // bn, kp // bk),
        in_specs=[
            pl.BlockSpec((bm, hk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bm, hk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((hk, bn), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((ng, bn), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((ng, bn), lambda i, j, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=tpu_interpret_arg(interpret),
        name="int4_matmul_tpu",
    )(x_lo, x_hi, vp, sp, bp)
    return out[:m, :n]
