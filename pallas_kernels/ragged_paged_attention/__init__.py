"""Ragged paged attention for prefill and mixed prefill/decode batches (TPU Mosaic or GPU Triton).

Signature::

    ragged_paged_attention(q, k_pages, v_pages, page_table, context_lens, query_start_loc, num_seqs, *,
                           k_scale=None, v_scale=None, sm_scale=None, sliding_window=None, backend=None,
                           interpret=False, queries_per_block=None, pages_per_compute_block=None)

* q: [num_tokens, num_q_heads, head_dim], a flat batch of query rows.  Sequence i
  owns rows query_start_loc[i]:query_start_loc[i+1] (i < num_seqs); rows owned by
  no sequence (padding) produce zeros.
* k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] in q's dtype, or
  int8 with k_scale, v_scale f32[num_kv_heads, num_pages, page_size] (value = int8 * scale).
* page_table: i32[max_seqs, max_pages_per_seq]; context_lens: i32[max_seqs] is the
  total length INCLUDING the new tokens, whose K/V are already in the pages.
* query_start_loc: i32[max_seqs + 1] (cumulative; only the first num_seqs + 1
  entries are read); num_seqs: i32 scalar or i32[1] (a Python int is accepted).
* Query row j of sequence i sits at position context_lens[i] - q_len_i + j and
  attends to keys at positions <= its own, and > position - sliding_window when
  sliding_window is given.
* queries_per_block: query tokens per kernel step (a step never spans two
  sequences); pages_per_compute_block: KV pages per inner step.  Defaults come
  from untuned heuristics.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import resolve_backend
from pallas_kernels.ragged_paged_attention.reference import reference_ragged_paged_attention
from pallas_kernels.ragged_paged_attention.validation import validate_ragged

__all__ = ["ragged_paged_attention", "reference_ragged_paged_attention"]


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "backend", "interpret", "queries_per_block",
                     "pages_per_compute_block"),
)
def _ragged_jit(q, k_pages, v_pages, page_table, context_lens, query_start_loc, num_seqs, k_scale, v_scale, *,
                sm_scale, sliding_window, backend, interpret, queries_per_block, pages_per_compute_block):
    dims = validate_ragged(
        q, k_pages, v_pages, page_table, context_lens, query_start_loc, num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, backend=backend, queries_per_block=queries_per_block,
        pages_per_compute_block=pages_per_compute_block, k_scale=k_scale, v_scale=v_scale,
    )
    if backend == "tpu":
        from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu as impl
    else:
        from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu as impl
    return impl(
        q, k_pages, v_pages, page_table, context_lens, query_start_loc, num_seqs, k_scale, v_scale, dims=dims,
        queries_per_block=queries_per_block, pages_per_compute_block=pages_per_compute_block, interpret=interpret,
    )


def ragged_paged_attention(
    q,  # [num_tokens, num_q_heads, head_dim]
    k_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    page_table,  # i32[max_seqs, max_pages_per_seq]
    context_lens,  # i32[max_seqs]
    query_start_loc,  # i32[max_seqs + 1]
    num_seqs,  # i32[] | i32[1] | int
    *,
    k_scale=None,  # f32[num_kv_heads, num_pages, page_size] for an int8 cache
    v_scale=None,  # f32[num_kv_heads, num_pages, page_size] for an int8 cache
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    backend: str | None = None,
    interpret: bool = False,
    queries_per_block: int | None = None,
    pages_per_compute_block: int | None = None,
):
    """Returns [num_tokens, num_q_heads, head_dim] in q's dtype; see the module docstring."""
    backend = resolve_backend(backend, interpret, fn_name="ragged_paged_attention")
    if isinstance(num_seqs, int):
        num_seqs = jnp.asarray(num_seqs, jnp.int32)
    return _ragged_jit(
        q, k_pages, v_pages, page_table, context_lens, query_start_loc, num_seqs, k_scale, v_scale,
        sm_scale=None if sm_scale is None else float(sm_scale),
        sliding_window=None if sliding_window is None else int(sliding_window), backend=backend,
        interpret=bool(interpret), queries_per_block=queries_per_block,
        pages_per_compute_block=pages_per_compute_block,
    )
