"""Ragged paged attention for TPUs (Mosaic): one grid step = one query block of one sequence x one KV head."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import cdiv, pad_axis, tpu_interpret_arg
from pallas_kernels.paged_attention.reference import gather_pages
from pallas_kernels.paged_attention.tpu import (
    PageCopies,
    as_f32_select,
    attention_scratch,
    softmax_finish,
    softmax_init,
    softmax_update,
)
from pallas_kernels.ragged_paged_attention import plan as plan_lib
from pallas_kernels.ragged_paged_attention.validation import RaggedDims

# Initial guesses, untuned on hardware: ~256 query rows (tokens x heads of a
# group) and 256 key tokens per step keep the [rows, keys] logits tile at
# 256 KiB f32 and the MXU busy for prefill.
_TARGET_ROWS = 256
_TARGET_BLOCK_TOKENS = 256


def default_queries_per_block(num_tokens: int, max_seqs: int, group: int) -> int:
    # Decode-heavy batches (about one token per sequence) want small blocks,
    # since a block never spans two sequences; prefill wants big ones.
    avg = cdiv(num_tokens, max(1, max_seqs))
    bq = 8
    while bq < min(avg, 128) and 2 * bq * group <= _TARGET_ROWS:
        bq *= 2
    return bq


def default_pages_per_block(page_size: int, max_pages: int) -> int:
    return max(1, min(max_pages, _TARGET_BLOCK_TOKENS // page_size))


def _ragged_kernel(
    seq_ref,  # SMEM i32[W] sequence of each work item
    qlen_ref,  # SMEM i32[W] query rows of each work item (0 = idle)
    pos_ref,  # SMEM i32[W] cache position of each item's first query token
    pt_ref,  # SMEM i32[max_seqs * max_pages] flattened page table
    q_ref,  # VMEM [bq * group, head_dim] rows token-major
    k_hbm,  # HBM [num_kv_heads, num_pages, page_size, head_dim]
    v_hbm,  # HBM [num_kv_heads, num_pages, page_size, head_dim]
    ks_ref,  # VMEM f32[nb, bk] | None  the item's sequence's K scales in token order (int8 cache)
    vs_ref,  # VMEM f32[nb, bk] | None
    o_ref,  # VMEM [bq * group, head_dim]
    kbuf,  # VMEM [2, ppcb, page_size, head_dim]
    vbuf,  # VMEM [2, ppcb, page_size, head_dim]
    sems,  # DMA [2, 2]
    m_ref,  # VMEM f32[rows, 128]
    l_ref,  # VMEM f32[rows, 128]
    acc_ref,  # VMEM f32[rows, head_dim]
    *,
    sm_scale: float,
    ppcb: int,
    max_pages: int,
    group: int,
    window: int | None,
):
    w = pl.program_id(0)
    h = pl.program_id(1)
    rows, head_dim = q_ref.shape
    page_size = kbuf.shape[2]
    bk = ppcb * page_size
    seq = seq_ref[w]
    q_len = qlen_ref[w]
    p0 = pos_ref[w]
    hi = p0 + q_len  # keys [lo, hi) are visible to some row of this item
    lo = jnp.maximum(p0 - window + 1, 0) if window is not None else jnp.int32(0)
    # lax.div, not //: jnp floor division lowers through `sign`, which needs a real TPU to lower.
    blk_lo = lax.div(lo, bk)
    nblk = jnp.where(q_len > 0, lax.div(hi + bk - 1, bk) - blk_lo, 0)
    copies = functools.partial(
        PageCopies, pt_ref, k_hbm, v_hbm, kbuf, vbuf, sems, row=seq, h=h, page_lo=lax.div(lo, page_size),
        page_hi=lax.div(hi + page_size - 1, page_size), ppcb=ppcb, max_pages=max_pages,
    )

    softmax_init(m_ref, l_ref, acc_ref)

    @pl.when(nblk > 0)
    def _():
        copies(blk=blk_lo, slot=0).start()

    q = q_ref[...]
    compute_dtype = q.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    quantized = ks_ref is not None

    def body(i, carry):
        slot = lax.rem(i, 2)
        blk = blk_lo + i

        @pl.when(i + 1 < nblk)
        def _():
            copies(blk=blk + 1, slot=1 - slot).start()

        copies(blk=blk, slot=slot).wait()
        if quantized:  # int8 -> f32 -> compute dtype (exact), as in the decode kernel
            k = kbuf[slot].astype(jnp.float32).reshape(bk, head_dim).astype(compute_dtype)
            v = vbuf[slot].astype(jnp.float32).reshape(bk, head_dim)
        else:
            k = kbuf[slot].reshape(bk, head_dim)
            v = vbuf[slot].reshape(bk, head_dim)
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
        ) * sm_scale
        if quantized:
            s = s * ks_ref[pl.ds(blk, 1), :]
        # Row r is query token r // group.  Compare rel * group <= r instead of
        # dividing, which avoids a vector integer division:
        #   key <= query pos  <=>  (key - p0) <= r // group  <=>  (key - p0) * group <= r.
        r = lax.broadcasted_iota(jnp.int32, (rows, bk), 0)
        rel = blk * bk + lax.broadcasted_iota(jnp.int32, (rows, bk), 1) - p0
        allowed = jnp.logical_and(rel * group <= r, r < q_len * group)
        if window is not None:
            allowed = jnp.logical_and(allowed, r < (rel + window) * group)
        # V rows outside [lo, hi) may come from pages that were never fetched.
        kpos = blk * bk + lax.broadcasted_iota(jnp.int32, (bk, head_dim), 0)
        v = as_f32_select(v, jnp.logical_and(kpos >= lo, kpos < hi)).astype(compute_dtype)
        softmax_update(s, allowed, v, m_ref, l_ref, acc_ref, precision=precision,
                       p_scale=vs_ref[pl.ds(blk, 1), :] if quantized else None)
        return carry

    lax.fori_loop(0, nblk, body, 0)
    softmax_finish(o_ref, l_ref, acc_ref)


def ragged_paged_attention_tpu(
    q,  # [num_tokens, num_q_heads, head_dim]
    k_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    page_table,  # i32[max_seqs, max_pages]
    context_lens,  # i32[max_seqs]
    query_start_loc,  # i32[max_seqs + 1]
    num_seqs,  # i32[] or i32[1]
    k_scale,  # f32[num_kv_heads, num_pages, page_size] | None
    v_scale,  # f32[num_kv_heads, num_pages, page_size] | None
    *,
    dims: RaggedDims,
    queries_per_block: int | None,
    pages_per_compute_block: int | None,
    interpret: bool,
):
    d = dims
    bq = queries_per_block or default_queries_per_block(d.num_tokens, d.max_seqs, d.group)
    ppcb = min(pages_per_compute_block or default_pages_per_block(d.page_size, d.max_pages), d.max_pages)
    # Defensive clamp: a context longer than the table would index past it.
    context_lens = jnp.clip(context_lens, 0, d.max_pages * d.page_size)
    plan = plan_lib.make_plan(
        context_lens, query_start_loc, num_seqs, num_tokens=d.num_tokens, max_seqs=d.max_seqs, bq=bq
    )
    rows = bq * d.group
    qw = plan_lib.arrange_queries(plan_lib.gather_queries(q, plan), d.num_kv_heads, d.group, d.group)

    row_spec = pl.BlockSpec((None, None, rows, d.head_dim), lambda w, h, *_: (w, h, 0, 0))
    in_specs = [row_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    scale_args = [None, None]
    if d.quantized:
        # As in the decode kernel: each sequence's scales gathered in token order, [nb, bk] per
        # (sequence, KV head), so a block reads one lane-dense row; the item's sequence picks the block.
        bk, nb = ppcb * d.page_size, cdiv(d.max_pages, ppcb)
        scale_args = [pad_axis(gather_pages(s, page_table), 2, nb * bk).reshape(d.max_seqs, d.num_kv_heads, nb, bk)
                      for s in (k_scale, v_scale)]
        scale_spec = pl.BlockSpec((None, None, nb, bk), lambda w, h, seq_ref, *_: (seq_ref[w], h, 0, 0))
        in_specs += [scale_spec, scale_spec]
    else:
        in_specs += [None, None]
    scratch = attention_scratch(ppcb, d.page_size, d.head_dim, k_pages.dtype, rows)
    ow = pl.pallas_call(
        functools.partial(
            _ragged_kernel, sm_scale=d.sm_scale, ppcb=ppcb, max_pages=d.max_pages, group=d.group,
            window=d.sliding_window,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(plan.num_items, d.num_kv_heads),
            in_specs=in_specs,
            out_specs=row_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(qw.shape, q.dtype),
        # Steps share nothing (each prefetches only its own blocks): both axes parallel.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=tpu_interpret_arg(interpret),
        name="ragged_paged_attention_tpu",
    )(plan.seq, plan.q_len, plan.first_pos, page_table.reshape(-1), qw, k_pages, v_pages, *scale_args)
    return plan_lib.scatter_outputs(
        ow, plan, query_start_loc, num_seqs, num_tokens=d.num_tokens, max_seqs=d.max_seqs,
        num_kv_heads=d.num_kv_heads, group=d.group, group_padded=d.group, dtype=q.dtype,
    )
