"""Trace-time checks of paged-attention inputs; every failure is a ValueError that names the bad argument."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels._common import check_float_dtype, check_int32, is_pow2, tpu_sublane_tile

FN = "paged_attention"


@dataclasses.dataclass(frozen=True)
class PagedDims:
    batch: int
    num_q_heads: int
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    num_pages: int
    page_size: int
    max_pages: int  # page-table columns per sequence
    quantized: bool
    sm_scale: float


def validate_kv_cache(
    k_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    k_scale,  # f32[num_kv_heads, num_pages, page_size] | None
    v_scale,  # f32[num_kv_heads, num_pages, page_size] | None
    *,
    fn: str,
) -> bool:
    """Checks the cache arrays of one layer; returns True for an int8 cache with scales."""
    if k_pages.ndim != 4:
        raise ValueError(
            f"{fn}: k_pages must be [num_kv_heads, num_pages, page_size, head_dim], got shape {k_pages.shape}."
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"{fn}: v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}.")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"{fn}: k_pages ({k_pages.dtype}) and v_pages ({v_pages.dtype}) must share a dtype.")
    quantized = jnp.dtype(k_pages.dtype) == jnp.dtype(jnp.int8)
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"{fn}: pass both k_scale and v_scale or neither.")
    if quantized and k_scale is None:
        raise ValueError(f"{fn}: an int8 KV cache needs k_scale and v_scale ([num_kv_heads, num_pages, page_size] f32).")
    if not quantized and k_scale is not None:
        raise ValueError(f"{fn}: k_scale/v_scale are only valid with an int8 KV cache, got {k_pages.dtype} pages.")
    if not quantized:
        check_float_dtype("k_pages", k_pages, fn)
    if quantized:
        want = k_pages.shape[:3]
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s.shape != want:
                raise ValueError(f"{fn}: {name} must have shape {want} (= k_pages.shape[:3]), got {s.shape}.")
            if jnp.dtype(s.dtype) != jnp.dtype(jnp.float32):
                raise ValueError(f"{fn}: {name} must be float32, got {s.dtype}.")
    return quantized


def validate_heads(
    q,  # [rows, num_q_heads, head_dim]
    k_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    *,
    fn: str,
) -> None:
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, head_dim_k = k_pages.shape[0], k_pages.shape[3]
    if head_dim_k != head_dim:
        raise ValueError(f"{fn}: q head_dim {head_dim} != k_pages head_dim {head_dim_k}.")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{fn}: num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")


def validate_block_sizes(backend: str | None, *, fn: str, **sizes: int | None) -> None:
    """Tuning block sizes (None = default): >= 1, and powers of two for the GPU (Triton) kernels."""
    for name, val in sizes.items():
        if val is not None and val < 1:
            raise ValueError(f"{fn}: {name} must be >= 1, got {val}.")
        if backend == "gpu" and val is not None and not is_pow2(val):
            raise ValueError(f"{fn}: the GPU kernel needs a power-of-two {name}, got {val}.")


def validate_backend_layout(backend: str, *, page_size: int, head_dim: int, kv_dtype, q_dtype, fn: str) -> None:
    """Alignment rules of each lowering (checked for the chosen backend only)."""
    if backend == "tpu":
        # Pages are DMA'd whole into VMEM and several pages are viewed as one
        # [tokens, head_dim] matrix; that view is free only when a page covers
        # whole native (sublane x lane) tiles of the cache dtype.
        tile = tpu_sublane_tile(kv_dtype)
        if page_size % tile:
            raise ValueError(
                f"{fn}: the TPU kernel needs page_size to be a multiple of {tile} for a "
                f"{jnp.dtype(kv_dtype).name} cache (one native sublane tile), got {page_size}."
            )
        if head_dim % 64:
            raise ValueError(f"{fn}: the TPU kernel needs head_dim to be a multiple of 64, got {head_dim}.")
    elif backend == "gpu":
        # Triton tensors must have power-of-two sizes and tl.dot needs K >= 16.
        if not is_pow2(page_size):
            raise ValueError(f"{fn}: the GPU (Triton) kernel needs a power-of-two page_size, got {page_size}.")
        if not is_pow2(head_dim) or head_dim < 16:
            raise ValueError(f"{fn}: the GPU (Triton) kernel needs a power-of-two head_dim >= 16, got {head_dim}.")
    del q_dtype


def validate_paged_attention(
    q,  # [batch, num_q_heads, head_dim]
    k_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    seq_lens,  # i32[batch]
    page_table,  # i32[batch, max_pages]
    k_scale,  # f32[num_kv_heads, num_pages, page_size] | None
    v_scale,  # f32[num_kv_heads, num_pages, page_size] | None
    sm_scale: float | None,
    backend: str | None,
    pages_per_compute_block: int | None,
) -> PagedDims:
    fn = FN
    if q.ndim != 3:
        raise ValueError(f"{fn}: q must be [batch, num_q_heads, head_dim], got shape {q.shape}.")
    check_float_dtype("q", q, fn)
    quantized = validate_kv_cache(k_pages, v_pages, k_scale, v_scale, fn=fn)
    if not quantized and k_pages.dtype != q.dtype:
        raise ValueError(f"{fn}: k_pages/v_pages dtype {k_pages.dtype} must equal q dtype {q.dtype} (or be int8).")
    validate_heads(q, k_pages, fn=fn)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    if seq_lens.shape != (batch,):
        raise ValueError(f"{fn}: seq_lens must have shape ({batch},), got {seq_lens.shape}.")
    check_int32("seq_lens", seq_lens, fn)
    if page_table.ndim != 2 or page_table.shape[0] != batch:
        raise ValueError(f"{fn}: page_table must be [batch={batch}, max_pages_per_seq], got {page_table.shape}.")
    check_int32("page_table", page_table, fn)
    if page_table.shape[1] < 1:
        raise ValueError(f"{fn}: page_table needs at least one column.")
    validate_block_sizes(backend, fn=fn, pages_per_compute_block=pages_per_compute_block)
    if sm_scale is None:
        sm_scale = head_dim ** -0.5
    if backend is not None:
        validate_backend_layout(
            backend, page_size=page_size, head_dim=head_dim, kv_dtype=k_pages.dtype, q_dtype=q.dtype, fn=fn
        )
    return PagedDims(
        batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, group=num_q_heads // num_kv_heads,
        head_dim=head_dim, num_pages=num_pages, page_size=page_size, max_pages=page_table.shape[1],
        quantized=quantized, sm_scale=float(sm_scale),
    )
