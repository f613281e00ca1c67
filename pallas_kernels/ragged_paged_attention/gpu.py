"""Ragged paged attention for GPUs through the Pallas Triton lowering (one program = query block x KV head x
split of its keys).

The kernel takes the whole stacked cache (k, v [L, K, NP, S, H]; int8 scales [L, K, NP, S]) and the
layer as a scalar operand that its loads index with (Triton index maps cannot read operands), so no
layer is sliced (copied) out of the cache before the call.

Decode rows keep their parallelism over context: each work item's key blocks are split over a third
grid axis (flash-decoding; `split_plan` picks the split count from the static number of programs),
each split writes an unnormalised f32 partial output with its running max and denominator, and the
splits are merged after the kernel. A batch of many items gets one split, which finishes its
softmax in the kernel and writes q's dtype (no partials, no merge); a few long decodes get up to one
split per key block."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import MASK_VALUE, cdiv, next_pow2, pad_axis, round_up
from pallas_kernels.ragged_paged_attention import plan as plan_lib
from pallas_kernels.ragged_paged_attention.validation import RaggedDims

# Initial guesses, untuned: <= 128 query rows and 64 key tokens per step keep
# the logits tile and the gathered K/V tile in registers.
_MAX_ROWS = 128
_TARGET_BLOCK_TOKENS = 64
# Enough programs to fill a large GPU (~132 SMs) about twice; initial guess.
_TARGET_PROGRAMS = 256


def check_block_tokens(ppcb: int, page_size: int, fn: str) -> None:
    if ppcb * page_size < 16:
        raise ValueError(
            f"{fn}: the GPU kernel needs pages_per_compute_block * page_size >= 16, got {ppcb} * {page_size}."
        )


def softmax_start(rows: int, head_dim: int):
    """Online-softmax loop carry of the GPU attention kernels: (numerator, running max, denominator)."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def softmax_update(
    carry,  # (acc f32[rows, head_dim], m f32[rows], l f32[rows])
    s,  # f32[rows, bk] scaled logits of one key block
    mask,  # bool[rows, bk] (or broadcastable) visible keys
    v,  # [bk, head_dim] values in the compute dtype, masked rows already zeroed (0 * NaN = NaN)
    p_scale=None,  # f32[1, bk] per-token V scales (int8 cache) | None
):
    """One key block of the online softmax ; returns the new carry."""
    acc, m, l = carry
    # Select rather than add the mask: K slots past the length may hold NaN.
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=1)
    if p_scale is not None:
        # Re-select after scaling: a masked slot's scale may be NaN.
        p = jnp.where(mask, p * p_scale, 0.0)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l_new


def default_queries_per_block(num_tokens: int, max_seqs: int, group_padded: int) -> int:
    avg = cdiv(num_tokens, max(1, max_seqs))
    bq = max(1, cdiv(16, group_padded))  # tl.dot needs M >= 16
    while bq < min(avg, 64) and 2 * bq * group_padded <= _MAX_ROWS:
        bq *= 2
    return bq


def default_pages_per_block(page_size: int) -> int:
    return next_pow2(max(1, _TARGET_BLOCK_TOKENS // page_size, cdiv(16, page_size)))


def split_plan(num_items: int, num_kv_heads: int, max_blocks: int) -> tuple[int, int]:
    """(splits, blocks_per_split) of each work item's keys: enough programs to fill the GPU."""
    want = max(1, _TARGET_PROGRAMS // max(1, num_items * num_kv_heads))
    per_split = cdiv(max_blocks, max(1, min(max_blocks, want)))
    return cdiv(max_blocks, per_split), per_split


def _ragged_kernel(
    seq_ref,  # i32[] sequence of this work item
    qlen_ref,  # i32[] query rows of this item (0 = idle)
    pos_ref,  # i32[] cache position of the item's first query token
    layer_ref,  # i32[] layer of the stacked cache to attend over
    window_ref,  # i32[] sliding window, clamped to [1, max_pages * page_size]
    scale_ref,  # f32[] softmax scale
    pt_ref,  # i32[max_seqs, max_pages_padded] whole page table
    q_ref,  # [bq * gp, head_dim] rows token-major
    k_ref,  # [L, num_pages, page_size, head_dim] this KV head's pages of every layer
    v_ref,  # [L, num_pages, page_size, head_dim]
    ks_ref,  # f32[L, num_pages, page_size] | None  (int8 cache)
    vs_ref,  # f32[L, num_pages, page_size] | None
    o_ref,  # [bq * gp, head_dim]: q's dtype, normalised (one split); f32 unnormalised partial (several)
    m_ref=None,  # f32[bq * gp] running max of this split (several splits only)
    l_ref=None,  # f32[bq * gp] softmax denominator of this split
    *,
    ppcb: int,
    blocks_per_split: int,
    group: int,
):
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[2]
    bk = ppcb * page_size
    seq = seq_ref[...]
    q_len = qlen_ref[...]
    p0 = pos_ref[...]
    layer = layer_ref[...]
    window = window_ref[...]
    sm_scale = scale_ref[...]
    hi = p0 + q_len
    lo = jnp.maximum(p0 - window + 1, 0)
    blk_lo = lo // bk
    blk_hi = jnp.where(q_len > 0, pl.cdiv(hi, bk), blk_lo)
    # This split's share of the item's key blocks (empty past the item's last block).
    first = blk_lo + pl.program_id(2) * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, blk_hi)
    page_lo = lo // page_size
    page_hi = pl.cdiv(hi, page_size)
    q = q_ref[...]
    r = lax.broadcasted_iota(jnp.int32, (rows, bk), 0)
    col = lax.broadcasted_iota(jnp.int32, (rows, bk), 1)

    def body(blk, carry):
        page_idx = blk * ppcb + lax.broadcasted_iota(jnp.int32, (ppcb,), 0)
        ids = pt_ref[seq, pl.ds(blk * ppcb, ppcb)]
        # Never follow table entries outside the visible pages (may be garbage).
        ids = jnp.where(jnp.logical_and(page_idx >= page_lo, page_idx < page_hi), ids, 0)
        # An int8 cache widens to q's dtype (exact); its scales multiply the logits and probabilities.
        k = k_ref[layer, ids].reshape(bk, head_dim).astype(q.dtype)
        v = v_ref[layer, ids].reshape(bk, head_dim).astype(q.dtype)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * sm_scale
        if ks_ref is not None:
            s = s * ks_ref[layer, ids].reshape(1, bk)
        # Row r is query token r // group; (key - p0) * group <= r <=> causal.
        rel = blk * bk + col - p0
        allowed = jnp.logical_and(rel * group <= r, r < q_len * group)
        allowed = jnp.logical_and(allowed, r < (rel + window) * group)
        kpos = blk * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
        v_ok = jnp.logical_and(kpos >= lo, kpos < hi)
        v = jnp.where(v_ok[:, None], v, jnp.zeros_like(v))  # 0 * NaN guard
        p_scale = vs_ref[layer, ids].reshape(1, bk) if vs_ref is not None else None
        return softmax_update(carry, s, allowed, v, p_scale)

    acc, m, l = lax.fori_loop(first, last, body, softmax_start(rows, head_dim))
    if m_ref is None:  # the only split: finish here (no visible key -> zeros)
        o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)
    else:
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def ragged_paged_attention_gpu(
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
    gp = next_pow2(d.group)  # Triton tensors are power-of-two sized
    bq = queries_per_block or default_queries_per_block(d.num_tokens, d.max_seqs, gp)
    rows = bq * gp
    if rows < 16:
        raise ValueError(
            f"ragged_paged_attention: the GPU kernel needs queries_per_block * next_pow2(group) >= 16 "
            f"(tl.dot minimum), got {bq} * {gp}."
        )
    ppcb = pages_per_compute_block or default_pages_per_block(d.page_size)
    check_block_tokens(ppcb, d.page_size, "ragged_paged_attention")
    context_lens = jnp.clip(context_lens, 0, d.max_pages * d.page_size)
    plan = plan_lib.make_plan(
        context_lens, query_start_loc, num_seqs, num_tokens=d.num_tokens, max_seqs=d.max_seqs, bq=bq
    )
    qw = plan_lib.arrange_queries(plan_lib.gather_queries(q, plan), d.num_kv_heads, d.group, gp)
    # Whole blocks of table columns are loaded; pad so the last one stays in bounds.
    max_blocks = cdiv(d.max_pages, ppcb)
    splits, per_split = split_plan(plan.num_items, d.num_kv_heads, max_blocks)
    pt = pad_axis(page_table, 1, round_up(d.max_pages, ppcb))
    layer, window = ints[0:1], ints[1:2]

    item_spec = pl.BlockSpec((None,), lambda w, h, s: (w,))
    one_spec = pl.BlockSpec((None,), lambda w, h, s: (0,))
    row_spec = pl.BlockSpec((None, None, rows, d.head_dim), lambda w, h, s: (w, h, 0, 0))
    L = d.num_layers
    page_spec = pl.BlockSpec((L, None, d.num_pages, d.page_size, d.head_dim), lambda w, h, s: (0, h, 0, 0, 0))
    scale_spec = (
        pl.BlockSpec((L, None, d.num_pages, d.page_size), lambda w, h, s: (0, h, 0, 0)) if d.quantized else None
    )
    shape = (plan.num_items, d.num_kv_heads, splits, rows)
    part_specs = [
        pl.BlockSpec((None, None, None, rows, d.head_dim), lambda w, h, s: (w, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda w, h, s: (w, h, s, 0)),
        pl.BlockSpec((None, None, None, rows), lambda w, h, s: (w, h, s, 0)),
    ]
    part_shapes = [
        jax.ShapeDtypeStruct((*shape, d.head_dim), jnp.float32),
        jax.ShapeDtypeStruct(shape, jnp.float32),
        jax.ShapeDtypeStruct(shape, jnp.float32),
    ]
    if splits == 1:  # one split (many items, or short rows): the normalised output in q's dtype, no merge
        part_specs, part_shapes = part_specs[:1], [jax.ShapeDtypeStruct((*shape, d.head_dim), q.dtype)]
    parts = pl.pallas_call(
        functools.partial(_ragged_kernel, ppcb=ppcb, blocks_per_split=per_split, group=gp),
        grid=(plan.num_items, d.num_kv_heads, splits),
        in_specs=[
            item_spec,
            item_spec,
            item_spec,
            one_spec,
            one_spec,
            one_spec,
            pl.BlockSpec(pt.shape, lambda w, h, s: (0, 0)),
            row_spec,
            page_spec,
            page_spec,
            scale_spec,
            scale_spec,
        ],
        out_specs=part_specs,
        out_shape=part_shapes,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(plan.seq, plan.q_len, plan.first_pos, layer, window, sm_scale, pt, qw, k_pages, v_pages, k_scale, v_scale)
    if splits == 1:
        ow = parts[0][:, :, 0]  # [W, K, rows, H]
    else:
        # Merge the splits: rescale each partial sum to the global running max (an item with no
        # visible key has l == 0 everywhere and gives zeros).
        o, m, l = parts
        m_all = jnp.max(m, axis=2, keepdims=True)
        wgt = jnp.exp(m - m_all)  # [W, K, splits, rows]
        num = jnp.sum(o * wgt[..., None], axis=2)
        den = jnp.sum(l * wgt, axis=2)
        ow = num / jnp.where(den == 0.0, 1.0, den)[..., None]  # [W, K, rows, H]
    return plan_lib.scatter_outputs(
        ow,
        plan,
        query_start_loc,
        num_seqs,
        num_tokens=d.num_tokens,
        max_seqs=d.max_seqs,
        num_kv_heads=d.num_kv_heads,
        group=d.group,
        group_padded=gp,
        dtype=q.dtype,
    )
