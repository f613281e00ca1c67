"""int8 weight-only matmul for TPUs (Mosaic): int8 weight tiles are widened (and, per group, scaled) in VMEM, f32 accumulation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import tpu_interpret_arg
from pallas_kernels.int8_matmul.blocks import BLOCK, COLUMN, TILE, pad_to_blocks, scale_mode


def _dequant_tile(
    w,  # f32[bk, bn]
    s,  # f32[bk // G, bn]
    group_size: int,
):  # -> f32[bk, bn]
    # One static, 8-row-aligned slice per group, its scale row broadcast over the sublanes: plain vector ops,
    # no relayout (the same form as the int4 kernel's).
    g = group_size
    parts = [w[i * g : (i + 1) * g] * s[i : i + 1] for i in range(s.shape[0])]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _kernel(
    x_ref,  # VMEM [bm, bk] x's dtype
    w_ref,  # VMEM i8[bk, bn]
    s_ref,  # VMEM f32[1, bn] (COLUMN, BLOCK) or f32[bk // G, bn] (TILE)
    o_ref,  # VMEM [bm, bn] x's dtype
    acc_ref,  # VMEM f32[bm, bn]
    *,
    mode: str,
    group_size: int,
):
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    x = x_ref[...]
    # int8 -> f32 -> x dtype: direct int8 -> bf16 converts are not native on
    # every TPU generation; both steps are exact for |w| <= 127.
    w = w_ref[...].astype(jnp.float32)
    if mode == TILE:
        w = _dequant_tile(w, s_ref[...], group_size)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    part = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32, precision=precision)
    if mode == BLOCK:
        # One group's scale per column for the whole block: it commutes with the block's k sum.
        part = part * s_ref[...]
    acc_ref[...] += part

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        acc = acc_ref[...]
        if mode == COLUMN:
            # The per-column scale commutes with the whole k reduction: apply it once.
            acc = acc * s_ref[...]
        o_ref[...] = acc.astype(o_ref.dtype)


def _scale_spec(sp, mode: str, group_size: int, bk: int, bn: int):
    """The scales, reshaped (free, row-major) so that a block's scale rows are a full-dimension block:
    Mosaic wants a block's last two dims to be multiples of (8, 128) or the array's own, and a K block
    holds 1 or bk // G scale rows, rarely a multiple of 8. Returns (operand, BlockSpec)."""
    rows, np_ = sp.shape
    if mode == COLUMN:  # f32[1, np]
        return sp, pl.BlockSpec((1, bn), lambda i, j, kk: (0, j))
    if mode == BLOCK:  # f32[kp // G, 1, np]: K block kk lies in group kk * bk // G
        per_group = group_size // bk  # lax.div: indices are >= 0, and `//`'s sign fix-up needs the TPU's generation
        return sp.reshape(rows, 1, np_), pl.BlockSpec((None, 1, bn), lambda i, j, kk: (lax.div(kk, per_group), 0, j))
    ng = bk // group_size  # TILE: f32[kp // bk, bk // G, np], K block kk's groups in slab kk
    return sp.reshape(rows // ng, ng, np_), pl.BlockSpec((None, ng, bn), lambda i, j, kk: (kk, 0, j))


def int8_matmul_tpu(
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
    sp, s_spec = _scale_spec(sp, mode, group_size, bk, bn)
    out = pl.pallas_call(
        functools.partial(_kernel, mode=mode, group_size=group_size),
        grid=(mp // bm, np_ // bn, kp // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            s_spec,
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=tpu_interpret_arg(interpret),
        name="int8_matmul_tpu",
    )(xp, wp, sp)
    return out[:m, :n]
