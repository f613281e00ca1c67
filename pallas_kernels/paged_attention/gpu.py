"""Paged decode attention for GPUs through the Pallas Triton lowering (split-K "flash decoding")."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import MASK_VALUE, cdiv, next_pow2, pad_axis
from pallas_kernels.paged_attention.reference import group_queries, ungroup_outputs
from pallas_kernels.paged_attention.validation import PagedDims

# Decode is bandwidth bound; ~64 tokens per step keeps the gathered K/V tile in
# registers while giving tl.dot an N >= 16 operand.  Initial guess, untuned.
_TARGET_BLOCK_TOKENS = 64
# Enough programs to fill a large GPU (~132 SMs) at least twice; initial guess.
_TARGET_PROGRAMS = 256


def default_pages_per_block(page_size: int, max_pages: int) -> int:
    ppcb = max(1, _TARGET_BLOCK_TOKENS // page_size)
    # tl.dot needs >= 16 key tokens per block; the page table is padded to fit.
    ppcb = max(ppcb, cdiv(16, page_size))
    return min(next_pow2(ppcb), max(next_pow2(max_pages), next_pow2(cdiv(16, page_size))))


def split_plan(max_pages: int, ppcb: int, batch: int, num_kv_heads: int) -> tuple[int, int]:
    """(num_splits, pages_per_split) of the sequence axis; each split is one program."""
    nblocks = cdiv(max_pages, ppcb)
    want = max(1, _TARGET_PROGRAMS // max(1, batch * num_kv_heads))
    splits = max(1, min(nblocks, want))
    blocks_per_split = cdiv(nblocks, splits)
    splits = cdiv(nblocks, blocks_per_split)
    return splits, blocks_per_split * ppcb


def check_block_tokens(ppcb: int, page_size: int, fn: str) -> None:
    if ppcb * page_size < 16:
        raise ValueError(
            f"{fn}: the GPU kernel needs pages_per_compute_block * page_size >= 16, got {ppcb} * {page_size}."
        )


def softmax_start(rows: int, head_dim: int):
    """Online-softmax loop carry of the GPU attention kernels: (numerator, running max, denominator)."""
    return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def softmax_update(
    carry,  # (acc f32[rows, head_dim], m f32[rows], l f32[rows])
    s,  # f32[rows, bk] scaled logits of one key block
    mask,  # bool[rows, bk] (or broadcastable) visible keys
    v,  # [bk, head_dim] values in the compute dtype, masked rows already zeroed (0 * NaN = NaN)
    p_scale=None,  # f32[1, bk] per-token V scales (int8 cache) | None
):
    """One key block of the online softmax (shared with the ragged kernel); returns the new carry."""
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


def _decode_kernel(
    lens_ref,  # i32[] this sequence's length
    pt_ref,  # i32[pages_per_split] this split's slice of the page table
    q_ref,  # [gp, head_dim] query heads of one KV head (zero padded to gp rows)
    k_ref,  # [num_pages, page_size, head_dim] this KV head's pages
    v_ref,  # [num_pages, page_size, head_dim]
    ks_ref,  # f32[num_pages, page_size] | None
    vs_ref,  # f32[num_pages, page_size] | None
    o_ref,  # f32[gp, head_dim] unnormalized partial output of this split
    m_ref,  # f32[gp] running max of this split
    l_ref,  # f32[gp] softmax denominator of this split
    *,
    sm_scale: float,
    ppcb: int,
):
    gp, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    pages_per_split = pt_ref.shape[0]
    bk = ppcb * page_size
    split = pl.program_id(2)
    length = lens_ref[...]
    first_page = split * pages_per_split
    pages_here = jnp.clip(pl.cdiv(length, page_size) - first_page, 0, pages_per_split)
    nblk = pl.cdiv(pages_here, ppcb)
    q = q_ref[...]
    compute_dtype = q.dtype

    def body(i, carry):
        local = i * ppcb + lax.broadcasted_iota(jnp.int32, (ppcb,), 0)
        ids = pt_ref[pl.ds(i * ppcb, ppcb)]
        # Table entries past the sequence may be stale or garbage: never follow them.
        ids = jnp.where(local < pages_here, ids, 0)
        k = k_ref[ids].reshape(bk, head_dim).astype(compute_dtype)
        v = v_ref[ids].reshape(bk, head_dim).astype(compute_dtype)
        tok = (first_page + i * ppcb) * page_size + lax.broadcasted_iota(jnp.int32, (bk,), 0)
        valid = tok < length
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s * sm_scale
        if ks_ref is not None:
            s = s * ks_ref[ids].reshape(1, bk)
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        p_scale = vs_ref[ids].reshape(1, bk) if vs_ref is not None else None
        return softmax_update(carry, s, valid[None, :], v, p_scale)

    acc, m, l = lax.fori_loop(0, nblk, body, softmax_start(gp, head_dim))
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def paged_attention_gpu(
    q,  # [batch, num_q_heads, head_dim]
    k_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    seq_lens,  # i32[batch]
    page_table,  # i32[batch, max_pages]
    k_scale,  # f32[num_kv_heads, num_pages, page_size] | None
    v_scale,  # f32[num_kv_heads, num_pages, page_size] | None
    *,
    dims: PagedDims,
    pages_per_compute_block: int | None,
    interpret: bool,
):
    d = dims
    gp = max(16, next_pow2(d.group))  # tl.dot needs M >= 16 and power-of-two tensors
    ppcb = pages_per_compute_block or default_pages_per_block(d.page_size, d.max_pages)
    check_block_tokens(ppcb, d.page_size, "paged_attention")
    splits, pps = split_plan(d.max_pages, ppcb, d.batch, d.num_kv_heads)

    qg = group_queries(q, d.num_kv_heads, gp)
    pt = pad_axis(page_table, 1, splits * pps)
    # A length beyond the table would index past it; clamp defensively.
    lens = jnp.clip(seq_lens, 0, d.max_pages * d.page_size)

    page_spec = pl.BlockSpec((None, d.num_pages, d.page_size, d.head_dim), lambda b, h, s: (h, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, d.num_pages, d.page_size), lambda b, h, s: (h, 0, 0))
    in_specs = [
        pl.BlockSpec((None,), lambda b, h, s: (b,)),
        pl.BlockSpec((None, pps), lambda b, h, s: (b, s)),
        pl.BlockSpec((None, None, gp, d.head_dim), lambda b, h, s: (b, h, 0, 0)),
        page_spec,
        page_spec,
        scale_spec if k_scale is not None else None,
        scale_spec if v_scale is not None else None,
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, gp, d.head_dim), lambda b, h, s: (b, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
        pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((d.batch, d.num_kv_heads, splits, gp, d.head_dim), jnp.float32),
        jax.ShapeDtypeStruct((d.batch, d.num_kv_heads, splits, gp), jnp.float32),
        jax.ShapeDtypeStruct((d.batch, d.num_kv_heads, splits, gp), jnp.float32),
    ]
    o, m, l = pl.pallas_call(
        functools.partial(_decode_kernel, sm_scale=d.sm_scale, ppcb=ppcb),
        grid=(d.batch, d.num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="paged_attention_decode_gpu",
    )(lens, pt, qg, k_pages, v_pages, k_scale, v_scale)

    # Merge the splits: rescale each partial sum to the global running max.
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)  # [b, hkv, splits, gp]
    num = jnp.sum(o * w[..., None], axis=2)
    den = jnp.sum(l * w, axis=2)
    out = num / jnp.where(den == 0.0, 1.0, den)[..., None]  # seq_len 0 -> zeros
    return ungroup_outputs(out, d.group).astype(q.dtype)
