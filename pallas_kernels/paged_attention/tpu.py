"""Paged decode attention for TPUs (Mosaic): scalar-prefetched page table, double-buffered page DMAs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import MASK_VALUE, cdiv, pad_axis, round_up, tpu_interpret_arg
from pallas_kernels.paged_attention.reference import gather_pages, group_queries, ungroup_outputs
from pallas_kernels.paged_attention.validation import PagedDims

# Tokens per compute block: big enough to amortise the per-block softmax
# bookkeeping and keep the DMA engine busy, small enough for two K and two V
# buffers to sit comfortably in VMEM.  Initial guess, untuned on hardware.
_TARGET_BLOCK_TOKENS = 256
_LANES = 128


def default_pages_per_block(page_size: int, max_pages: int) -> int:
    return max(1, min(max_pages, _TARGET_BLOCK_TOKENS // page_size))


class PageCopies:
    """The DMAs that bring one compute block (ppcb pages of K and V) into one buffer slot.

    Only pages in [page_lo, page_hi) are fetched and waited on: table entries
    outside that range may be stale or garbage, and the slot keeps whatever it
    held there (callers mask those rows).  Shared with the ragged kernel.
    """

    def __init__(
        self,
        pt_ref,  # SMEM i32[rows * max_pages] flattened page table
        k_hbm,  # HBM [num_kv_heads, num_pages, page_size, head_dim]
        v_hbm,  # HBM [num_kv_heads, num_pages, page_size, head_dim]
        kbuf,  # VMEM [2, ppcb, page_size, head_dim]
        vbuf,  # VMEM [2, ppcb, page_size, head_dim]
        sems,  # DMA semaphores [2 (k, v), 2 (slot)]
        *,
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
            ck = pltpu.make_async_copy(k_hbm.at[h, page], kbuf.at[slot, j], sems.at[0, slot])
            cv = pltpu.make_async_copy(v_hbm.at[h, page], vbuf.at[slot, j], sems.at[1, slot])
            self._copies.append((jnp.logical_and(idx >= page_lo, idx < page_hi), ck, cv))

    def start(self):
        for live, ck, cv in self._copies:
            @pl.when(live)
            def _():
                ck.start()
                cv.start()

    def wait(self):
        for live, ck, cv in self._copies:
            @pl.when(live)
            def _():
                ck.wait()
                cv.wait()


def as_f32_select(x, mask):
    # Selects on packed/int dtypes are not native on every TPU generation; f32 is.
    return jnp.where(mask, x.astype(jnp.float32), 0.0)


def attention_scratch(ppcb: int, page_size: int, head_dim: int, kv_dtype, rows: int) -> list:
    """VMEM scratch of the TPU attention kernels (shared with the ragged kernel): double-buffered K/V
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
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, precision=precision,
    )
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv


def softmax_finish(o_ref, l_ref, acc_ref) -> None:
    l = l_ref[...][:, :1]
    o_ref[...] = (acc_ref[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)  # no visible key -> zeros


def _decode_kernel(
    lens_ref,  # SMEM i32[batch]
    pt_ref,  # SMEM i32[batch * max_pages] (flattened page table)
    q_ref,  # VMEM [gp, head_dim] query heads of one KV head, zero padded to gp rows
    k_hbm,  # HBM [num_kv_heads, num_pages, page_size, head_dim]
    v_hbm,  # HBM [num_kv_heads, num_pages, page_size, head_dim]
    ks_ref,  # VMEM f32[nb, bk] | None  this sequence's K scales in token order
    vs_ref,  # VMEM f32[nb, bk] | None
    o_ref,  # VMEM [gp, head_dim]
    kbuf,  # VMEM [2, ppcb, page_size, head_dim] double buffer
    vbuf,  # VMEM [2, ppcb, page_size, head_dim]
    sems,  # DMA semaphores [2 (k, v), 2 (slot)]
    m_ref,  # VMEM f32[gp, 128] running max (lane-replicated)
    l_ref,  # VMEM f32[gp, 128] running denominator (lane-replicated)
    acc_ref,  # VMEM f32[gp, head_dim] running numerator
    *,
    sm_scale: float,
    ppcb: int,
    max_pages: int,
):
    b = pl.program_id(0)
    h = pl.program_id(1)
    gp, head_dim = q_ref.shape
    page_size = kbuf.shape[2]
    bk = ppcb * page_size
    length = lens_ref[b]
    # lax.div: jnp's floor division lowers through `sign`, which needs a real TPU to lower.
    n_pages = lax.div(length + page_size - 1, page_size)
    nblk = lax.div(length + bk - 1, bk)
    copies = functools.partial(
        PageCopies, pt_ref, k_hbm, v_hbm, kbuf, vbuf, sems, row=b, h=h, page_lo=0, page_hi=n_pages, ppcb=ppcb,
        max_pages=max_pages,
    )

    softmax_init(m_ref, l_ref, acc_ref)

    @pl.when(nblk > 0)
    def _():
        copies(blk=0, slot=0).start()

    q = q_ref[...]
    compute_dtype = q.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    quantized = ks_ref is not None

    def body(i, carry):
        slot = lax.rem(i, 2)

        # Prefetch the next block into the other slot before computing this one.
        @pl.when(i + 1 < nblk)
        def _():
            copies(blk=i + 1, slot=1 - slot).start()

        copies(blk=i, slot=slot).wait()
        if quantized:
            k = kbuf[slot].astype(jnp.float32).reshape(bk, head_dim).astype(compute_dtype)
            v = vbuf[slot].astype(jnp.float32).reshape(bk, head_dim)
        else:
            k = kbuf[slot].reshape(bk, head_dim)
            v = vbuf[slot].reshape(bk, head_dim)
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
        )
        s = s * sm_scale
        if quantized:
            s = s * ks_ref[pl.ds(i, 1), :]
        valid = i * bk + lax.broadcasted_iota(jnp.int32, (gp, bk), 1) < length
        v_valid = i * bk + lax.broadcasted_iota(jnp.int32, (bk, head_dim), 0) < length
        v = as_f32_select(v, v_valid).astype(compute_dtype)
        softmax_update(s, valid, v, m_ref, l_ref, acc_ref, precision=precision,
                       p_scale=vs_ref[pl.ds(i, 1), :] if quantized else None)
        return carry

    lax.fori_loop(0, nblk, body, 0)
    softmax_finish(o_ref, l_ref, acc_ref)  # seq_len 0 -> zeros


def paged_attention_tpu(
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
    # The query tile is [gp, head_dim]; padding the GQA group to a multiple of 8
    # rows gives Mosaic a whole sublane tile for any ratio (1, 2, 4, ...).
    gp = round_up(d.group, 8)
    ppcb = min(pages_per_compute_block or default_pages_per_block(d.page_size, d.max_pages), d.max_pages)
    bk = ppcb * d.page_size
    nb = cdiv(d.max_pages, ppcb)

    qg = group_queries(q, d.num_kv_heads, gp)
    lens = jnp.clip(seq_lens, 0, d.max_pages * d.page_size)
    pt_flat = page_table.reshape(-1)  # 1-D keeps SMEM padding small

    row_spec = pl.BlockSpec((None, None, gp, d.head_dim), lambda b, h, *_: (b, h, 0, 0))
    in_specs = [row_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    scale_args = []
    if d.quantized:
        # Per-token scales are tiny next to the pages; gathering them per
        # sequence in token order lets the kernel read one lane-dense [1, bk] row
        # per block instead of transposing per-page scale vectors.
        for s in (k_scale, v_scale):
            st = gather_pages(s, page_table)  # [b, hkv, max_pages * page_size]
            st = pad_axis(st, 2, nb * bk)
            scale_args.append(st.reshape(d.batch, d.num_kv_heads, nb, bk))
        scale_spec = pl.BlockSpec((None, None, nb, bk), lambda b, h, *_: (b, h, 0, 0))
        in_specs += [scale_spec, scale_spec]
    else:
        in_specs += [None, None]
        scale_args = [None, None]

    scratch = attention_scratch(ppcb, d.page_size, d.head_dim, k_pages.dtype, gp)
    out = pl.pallas_call(
        functools.partial(_decode_kernel, sm_scale=d.sm_scale, ppcb=ppcb, max_pages=d.max_pages),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(d.batch, d.num_kv_heads),
            in_specs=in_specs,
            out_specs=row_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct((d.batch, d.num_kv_heads, gp, d.head_dim), q.dtype),
        # Every (sequence, KV head) step is self-contained (it prefetches only
        # within itself), so both axes may be split across TensorCores.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=tpu_interpret_arg(interpret),
        name="paged_attention_decode_tpu",
    )(lens, pt_flat, qg, k_pages, v_pages, *scale_args)
    return ungroup_outputs(out, d.group)
