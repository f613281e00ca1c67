"""int8 weight-only matmul for TPUs (Mosaic): int8 weight tiles are widened in VMEM, f32 accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import tpu_interpret_arg
from pallas_kernels.int8_matmul.blocks import pad_to_blocks


def _kernel(
    x_ref,  # VMEM [bm, bk] x's dtype
    w_ref,  # VMEM i8[bk, bn]
    s_ref,  # VMEM f32[1, bn]
    o_ref,  # VMEM [bm, bn] x's dtype
    acc_ref,  # VMEM f32[bm, bn]
):
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    x = x_ref[...]
    # int8 -> f32 -> x dtype: direct int8 -> bf16 converts are not native on
    # every TPU generation; both steps are exact for |w| <= 127.
    w = w_ref[...].astype(jnp.float32).astype(x.dtype)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    acc_ref[...] += jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        # The per-column scale commutes with the k reduction: apply it once.
        o_ref[...] = (acc_ref[...] * s_ref[...]).astype(o_ref.dtype)


def int8_matmul_tpu(
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
    sp = sp.reshape(1, np_)
    out = pl.pallas_call(
        _kernel,
        grid=(mp // bm, np_ // bn, kp // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=tpu_interpret_arg(interpret),
        name="int8_matmul_tpu",
    )(xp, wp, sp)
    return out[:m, :n]
