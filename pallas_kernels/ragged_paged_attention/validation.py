"""Trace-time checks of ragged paged-attention inputs (shapes, dtypes, head ratio, backend alignment)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels._common import check_float_dtype, check_int32
from pallas_kernels.paged_attention.validation import (
    validate_backend_layout,
    validate_block_sizes,
    validate_heads,
    validate_kv_cache,
)

FN = "ragged_paged_attention"


@dataclasses.dataclass(frozen=True)
class RaggedDims:
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    num_pages: int
    page_size: int
    max_seqs: int
    max_pages: int
    sm_scale: float
    sliding_window: int | None
    quantized: bool = False  # int8 pages with f32 scales [num_kv_heads, num_pages, page_size]


def validate_ragged(
    q,  # [num_tokens, num_q_heads, head_dim]
    k_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    page_table,  # i32[max_seqs, max_pages]
    context_lens,  # i32[max_seqs]
    query_start_loc,  # i32[max_seqs + 1]
    num_seqs,  # i32[] | i32[1]
    *,
    sm_scale: float | None,
    sliding_window: int | None,
    backend: str | None,
    queries_per_block: int | None,
    pages_per_compute_block: int | None,
    k_scale=None,  # f32[num_kv_heads, num_pages, page_size] | None (int8 cache)
    v_scale=None,  # f32[num_kv_heads, num_pages, page_size] | None
) -> RaggedDims:
    fn = FN
    if q.ndim != 3:
        raise ValueError(f"{fn}: q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}.")
    check_float_dtype("q", q, fn)
    quantized = validate_kv_cache(k_pages, v_pages, k_scale, v_scale, fn=fn)
    if not quantized and k_pages.dtype != q.dtype:
        raise ValueError(f"{fn}: k_pages/v_pages dtype {k_pages.dtype} must equal q dtype {q.dtype} (or be int8).")
    validate_heads(q, k_pages, fn=fn)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    if page_table.ndim != 2 or page_table.shape[1] < 1:
        raise ValueError(f"{fn}: page_table must be [max_seqs, max_pages_per_seq], got {page_table.shape}.")
    check_int32("page_table", page_table, fn)
    max_seqs = page_table.shape[0]
    if context_lens.shape != (max_seqs,):
        raise ValueError(f"{fn}: context_lens must have shape ({max_seqs},) like page_table rows, got {context_lens.shape}.")
    check_int32("context_lens", context_lens, fn)
    if query_start_loc.shape != (max_seqs + 1,):
        raise ValueError(f"{fn}: query_start_loc must have shape ({max_seqs + 1},), got {query_start_loc.shape}.")
    check_int32("query_start_loc", query_start_loc, fn)
    if num_seqs.shape not in ((), (1,)):
        raise ValueError(f"{fn}: num_seqs must be an int32 scalar or shape (1,), got shape {num_seqs.shape}.")
    check_int32("num_seqs", num_seqs, fn)
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"{fn}: sliding_window must be a positive int or None, got {sliding_window!r}.")
    validate_block_sizes(backend, fn=fn, queries_per_block=queries_per_block,
                         pages_per_compute_block=pages_per_compute_block)
    if backend is not None:
        validate_backend_layout(
            backend, page_size=page_size, head_dim=head_dim, kv_dtype=k_pages.dtype, q_dtype=q.dtype, fn=fn
        )
    if sm_scale is None:
        sm_scale = head_dim ** -0.5
    return RaggedDims(
        num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        group=num_q_heads // num_kv_heads, head_dim=head_dim, num_pages=num_pages, page_size=page_size,
        max_seqs=max_seqs, max_pages=page_table.shape[1], sm_scale=float(sm_scale),
        sliding_window=None if sliding_window is None else int(sliding_window), quantized=quantized,
    )
