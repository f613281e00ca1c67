"""Ragged paged attention for TPUs (Mosaic): one grid step = one query block of one sequence x one KV head.

The kernel takes the whole stacked cache in HBM (k, v [L, K, NP, S, H]; int8 scales [L, K, NP, S])
and the layer as a scalar-prefetch operand, and DMAs only the pages of that layer its step reads:
no layer is sliced (copied) out of the cache before the call.

Decode rows are not split over their context here. A TensorCore runs its grid steps one after
another (only megacore chips split the parallel axes over two cores), so splitting a row's keys
over more grid steps would add a merge pass without adding concurrency; within a step the page
DMAs are double-buffered, so one decode row streams its whole context at HBM bandwidth. (The GPU
kernel, whose programs do run concurrently, splits.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import MASK_VALUE, cdiv, tpu_interpret_arg
from pallas_kernels.ragged_paged_attention import plan as plan_lib
from pallas_kernels.ragged_paged_attention.validation import RaggedDims

# Initial guesses, untuned on hardware: ~256 query rows (tokens x heads of a
# group) and 256 key tokens per step keep the [rows, keys] logits tile at
# 256 KiB f32 and the MXU busy for prefill.
_TARGET_ROWS = 256
_TARGET_BLOCK_TOKENS = 256
_LANES = 128


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


def as_f32_select(x, mask):
    # Selects on packed/int dtypes are not native on every TPU generation; f32 is.
    return jnp.where(mask, x.astype(jnp.float32), 0.0)


def attention_scratch(ppcb: int, page_size: int, head_dim: int, kv_dtype, rows: int) -> list:
    """VMEM scratch of the TPU attention kernel: double-buffered K/V
    pages, their DMA semaphores, and the online-softmax state for `rows` query rows."""
    return [
        pltpu.VMEM((2, ppcb, page_size, head_dim), kv_dtype),  # kbuf
        pltpu.VMEM((2, ppcb, page_size, head_dim), kv_dtype),  # vbuf
        pltpu.SemaphoreType.DMA((2, 2)),  # sems [k/v, slot]
        pltpu.VMEM((rows, _LANES), jnp.float32),  # m_ref: running max, lane-replicated
        pltpu.VMEM((rows, _LANES), jnp.float32),  # l_ref: running denominator, lane-replicated
        pltpu.VMEM((rows, head_dim), jnp.float32),  # acc_ref: running numerator
    ]


def softmax_init(m_ref, l_ref, acc_ref) -> None:
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def softmax_update(
    s,  # f32[rows, bk] scaled logits of one key block
    mask,  # bool[rows, bk] visible keys
    v,  # [bk, head_dim] values in the compute dtype, masked rows already zeroed (0 * NaN = NaN)
    m_ref,  # VMEM f32[rows, 128]
    l_ref,  # VMEM f32[rows, 128]
    acc_ref,  # VMEM f32[rows, head_dim]
    *,
    precision,
    p_scale=None,  # f32[1, bk] per-token V scales (int8 cache) | None
) -> None:
    """One key block of the online softmax, accumulated in VMEM."""
    # Select (not add) the mask: unfetched or stale slots may hold NaN.
    s = jnp.where(mask, s, MASK_VALUE)
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[:, :1]), 0.0)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_new
    if p_scale is not None:
        # Re-select after scaling: a masked slot's scale may be NaN.
        p = jnp.where(mask, p * p_scale, 0.0)
    pv = lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=precision,
    )
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv


def softmax_finish(o_ref, l_ref, acc_ref) -> None:
    l = l_ref[...][:, :1]
    o_ref[...] = (acc_ref[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)  # no visible key -> zeros


class _LayerPageCopies:
    """The DMAs that bring one compute block (ppcb pages of K and V, and their scales with an int8
    cache) of one layer and one KV head from the stacked HBM cache into one buffer slot.

    Only pages in [page_lo, page_hi) are fetched and waited on: table entries outside that range
    may be stale or garbage, and the slot keeps whatever it held there (the caller masks them)."""

    def __init__(
        self,
        pt_ref,  # SMEM i32[max_seqs * max_pages] flattened page table
        k_hbm,  # HBM [L, K, NP, S, H]
        v_hbm,  # HBM [L, K, NP, S, H]
        ks_hbm,  # HBM f32[L, K, NP, S] | None
        vs_hbm,  # HBM f32[L, K, NP, S] | None
        kbuf,  # VMEM [2, ppcb, S, H]
        vbuf,  # VMEM [2, ppcb, S, H]
        ksbuf,  # VMEM f32[2, ppcb, 1, S] | None
        vsbuf,  # VMEM f32[2, ppcb, 1, S] | None
        sems,  # DMA [4 (k, v, k scale, v scale), 2 (slot)]
        *,
        layer,  # i32[]
        row,  # i32[] page-table row (sequence)
        h,  # i32[] KV head
        blk,  # i32[] compute block index along the sequence
        slot,  # i32[] buffer slot (0/1)
        page_lo,  # i32[] first page worth fetching
        page_hi,  # i32[] one past the last page worth fetching
        ppcb: int,
        max_pages: int,
    ):
        self._copies = []
        for j in range(ppcb):
            idx = blk * ppcb + j
            # Clamp so the SMEM read stays in bounds even for skipped pages.
            page = pt_ref[row * max_pages + jnp.clip(idx, 0, max_pages - 1)]
            copies = [
                pltpu.make_async_copy(k_hbm.at[layer, h, page], kbuf.at[slot, j], sems.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[layer, h, page], vbuf.at[slot, j], sems.at[1, slot]),
            ]
            if ks_hbm is not None:  # a [1, S] row of scales per page: the page axis is untiled in the buffer
                copies += [
                    pltpu.make_async_copy(ks_hbm.at[layer, h, pl.ds(page, 1)], ksbuf.at[slot, j], sems.at[2, slot]),
                    pltpu.make_async_copy(vs_hbm.at[layer, h, pl.ds(page, 1)], vsbuf.at[slot, j], sems.at[3, slot]),
                ]
            self._copies.append((jnp.logical_and(idx >= page_lo, idx < page_hi), copies))

    def start(self):
        for live, copies in self._copies:

            @pl.when(live)
            def _():
                for c in copies:
                    c.start()

    def wait(self):
        for live, copies in self._copies:

            @pl.when(live)
            def _():
                for c in copies:
                    c.wait()


def _ragged_kernel(
    seq_ref,  # SMEM i32[W] sequence of each work item
    qlen_ref,  # SMEM i32[W] query rows of each work item (0 = idle)
    pos_ref,  # SMEM i32[W] cache position of each item's first query token
    pt_ref,  # SMEM i32[max_seqs * max_pages] flattened page table
    ints_ref,  # SMEM i32[2] (layer, sliding window clamped to [1, max_pages * page_size])
    scale_ref,  # SMEM f32[1] softmax scale
    q_ref,  # VMEM [bq * group, head_dim] rows token-major
    k_hbm,  # HBM [L, K, NP, S, H] the whole stacked cache
    v_hbm,  # HBM [L, K, NP, S, H]
    ks_hbm,  # HBM f32[L, K, NP, S] | None (int8 cache)
    vs_hbm,  # HBM f32[L, K, NP, S] | None
    o_ref,  # VMEM [bq * group, head_dim]
    kbuf,  # VMEM [2, ppcb, page_size, head_dim]
    vbuf,  # VMEM [2, ppcb, page_size, head_dim]
    sems,  # DMA [4, 2]
    m_ref,  # VMEM f32[rows, 128]
    l_ref,  # VMEM f32[rows, 128]
    acc_ref,  # VMEM f32[rows, head_dim]
    ksbuf=None,  # VMEM f32[2, ppcb, 1, page_size] (int8 cache)
    vsbuf=None,  # VMEM f32[2, ppcb, 1, page_size]
    *,
    ppcb: int,
    max_pages: int,
    group: int,
):
    w = pl.program_id(0)
    h = pl.program_id(1)
    rows, head_dim = q_ref.shape
    page_size = kbuf.shape[2]
    bk = ppcb * page_size
    seq = seq_ref[w]
    q_len = qlen_ref[w]
    p0 = pos_ref[w]
    layer = ints_ref[0]
    window = ints_ref[1]
    sm_scale = scale_ref[0]
    hi = p0 + q_len  # keys [lo, hi) are visible to some row of this item
    lo = jnp.maximum(p0 - window + 1, 0)
    # lax.div, not //: jnp floor division lowers through `sign`, which needs a real TPU to lower.
    blk_lo = lax.div(lo, bk)
    nblk = jnp.where(q_len > 0, lax.div(hi + bk - 1, bk) - blk_lo, 0)
    copies = functools.partial(
        _LayerPageCopies,
        pt_ref,
        k_hbm,
        v_hbm,
        ks_hbm,
        vs_hbm,
        kbuf,
        vbuf,
        ksbuf,
        vsbuf,
        sems,
        layer=layer,
        row=seq,
        h=h,
        page_lo=lax.div(lo, page_size),
        page_hi=lax.div(hi + page_size - 1, page_size),
        ppcb=ppcb,
        max_pages=max_pages,
    )

    softmax_init(m_ref, l_ref, acc_ref)

    @pl.when(nblk > 0)
    def _():
        copies(blk=blk_lo, slot=0).start()

    q = q_ref[...]
    compute_dtype = q.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    quantized = ks_hbm is not None

    def update(s, key0, keys, v, p_scale):
        """Online-softmax step over `keys` keys starting at cache position key0 (s: [rows, keys])."""
        # Row r is query token r // group.  Compare rel * group <= r instead of
        # dividing, which avoids a vector integer division:
        #   key <= query pos  <=>  (key - p0) <= r // group  <=>  (key - p0) * group <= r.
        r = lax.broadcasted_iota(jnp.int32, (rows, keys), 0)
        rel = key0 + lax.broadcasted_iota(jnp.int32, (rows, keys), 1) - p0
        allowed = jnp.logical_and(rel * group <= r, r < q_len * group)
        allowed = jnp.logical_and(allowed, r < (rel + window) * group)
        # V rows outside [lo, hi) may come from pages that were never fetched.
        kpos = key0 + lax.broadcasted_iota(jnp.int32, (keys, head_dim), 0)
        v = as_f32_select(v, jnp.logical_and(kpos >= lo, kpos < hi)).astype(compute_dtype)
        softmax_update(s, allowed, v, m_ref, l_ref, acc_ref, precision=precision, p_scale=p_scale)

    def scores(k):
        return (
            lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision)
            * sm_scale
        )

    def body(i, carry):
        slot = lax.rem(i, 2)
        blk = blk_lo + i

        @pl.when(i + 1 < nblk)
        def _():
            copies(blk=blk + 1, slot=1 - slot).start()

        copies(blk=blk, slot=slot).wait()
        if quantized:
            # Page by page: the scales arrive as one [1, page_size] row per page, which scales that
            # page's logit columns as it is (a sublane broadcast), with no lane relayout.
            for j in range(ppcb):
                k = kbuf[slot, j].astype(jnp.float32).astype(compute_dtype)  # int8 -> compute dtype: exact
                s = scores(k) * ksbuf[slot, j]
                update(s, (blk * ppcb + j) * page_size, page_size, vbuf[slot, j].astype(jnp.float32), vsbuf[slot, j])
        else:  # float8 pages widen through f32 (exact), as int8 ones do; the others are in q's dtype
            k = kbuf[slot].reshape(bk, head_dim)
            k = k if k.dtype == compute_dtype else k.astype(jnp.float32).astype(compute_dtype)
            update(scores(k), blk * bk, bk, vbuf[slot].reshape(bk, head_dim), None)
        return carry

    lax.fori_loop(0, nblk, body, 0)
    softmax_finish(o_ref, l_ref, acc_ref)


def ragged_paged_attention_tpu(
    q,  # [num_tokens, num_q_heads, head_dim]
    k_pages,  # [L, num_kv_heads, num_pages, page_size, head_dim] the whole stacked cache
    v_pages,  # [L, num_kv_heads, num_pages, page_size, head_dim]
    page_table,  # i32[max_seqs, max_pages]
    context_lens,  # i32[max_seqs]
    query_start_loc,  # i32[max_seqs + 1]
    num_seqs,  # i32[] or i32[1]
    k_scale,  # f32[L, num_kv_heads, num_pages, page_size] | None
    v_scale,  # f32[L, num_kv_heads, num_pages, page_size] | None
    ints,  # i32[2] (layer, clamped sliding window)
    sm_scale,  # f32[1]
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
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    scratch = attention_scratch(ppcb, d.page_size, d.head_dim, k_pages.dtype, rows)
    scratch[2] = pltpu.SemaphoreType.DMA((4, 2))
    if d.quantized:
        scratch += [pltpu.VMEM((2, ppcb, 1, d.page_size), jnp.float32)] * 2  # ksbuf, vsbuf
        in_specs = [row_spec, hbm, hbm, hbm, hbm]
    else:
        in_specs = [row_spec, hbm, hbm, None, None]
    ow = pl.pallas_call(
        functools.partial(_ragged_kernel, ppcb=ppcb, max_pages=d.max_pages, group=d.group),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
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
    )(
        plan.seq,
        plan.q_len,
        plan.first_pos,
        page_table.reshape(-1),
        ints,
        sm_scale,
        qw,
        k_pages,
        v_pages,
        k_scale,
        v_scale,
    )
    return plan_lib.scatter_outputs(
        ow,
        plan,
        query_start_loc,
        num_seqs,
        num_tokens=d.num_tokens,
        max_seqs=d.max_seqs,
        num_kv_heads=d.num_kv_heads,
        group=d.group,
        group_padded=d.group,
        dtype=q.dtype,
    )
