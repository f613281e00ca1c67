"""Ragged paged attention for prefill and mixed prefill/decode batches (TPU Mosaic or GPU Triton).

Signature::

    ragged_paged_attention(q, k_pages, v_pages, page_table, context_lens, query_start_loc, num_seqs, *,
                           k_scale=None, v_scale=None, sm_scale=None, sliding_window=None, layer=None,
                           backend=None, interpret=False, queries_per_block=None, pages_per_compute_block=None)

* q: [num_tokens, num_q_heads, head_dim], a flat batch of query rows.  Sequence i
  owns rows query_start_loc[i]:query_start_loc[i+1] (i < num_seqs); rows owned by
  no sequence (padding) produce zeros.
* k_pages, v_pages: the whole stacked cache [num_layers, num_kv_heads, num_pages, page_size,
  head_dim] with `layer` (an i32 scalar, may be traced: the kernels index the cache with it, so a
  scanned model passes its carry unsliced and no layer is copied out), or one layer
  [num_kv_heads, num_pages, page_size, head_dim] with layer=None.  In q's dtype, or int8 with
  k_scale, v_scale f32[(num_layers,) num_kv_heads, num_pages, page_size] (value = int8 * scale), or
  float8 (float8_e4m3fn, float8_e5m2; no scales: a per-tensor scale is the caller's to fold into q
  and the output, as jaxserve.model.kv_cache.attend does).  Pages are widened to q's dtype.
* page_table: i32[max_seqs, max_pages_per_seq]; context_lens: i32[max_seqs] is the
  total length INCLUDING the new tokens, whose K/V are already in the pages.
* query_start_loc: i32[max_seqs + 1] (cumulative; only the first num_seqs + 1
  entries are read); num_seqs: i32 scalar or i32[1] (a Python int is accepted).
* Query row j of sequence i sits at position context_lens[i] - q_len_i + j and
  attends to keys at positions <= its own, and > position - sliding_window when
  sliding_window is given.
* sm_scale (default head_dim ** -0.5) and sliding_window may be Python numbers or traced
  scalars (per-layer operands of a scan); both reach the kernels as operands.
* queries_per_block: query tokens per kernel step (a step never spans two
  sequences); pages_per_compute_block: KV pages per inner step.  Defaults come
  from untuned heuristics.

Decode rows keep their parallelism over context: the GPU kernel splits every work item's keys
over a third grid axis (flash-decoding; `gpu.split_plan`) and merges the partial softmaxes after
the kernel; the TPU kernel does not split (see `tpu.py`: a TensorCore runs its grid in sequence,
and the double-buffered page DMAs already stream a long context at full bandwidth).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import resolve_backend
from pallas_kernels.ragged_paged_attention.reference import reference_ragged_paged_attention
from pallas_kernels.ragged_paged_attention.validation import attention_scalars, validate_ragged

__all__ = ["ragged_paged_attention", "reference_ragged_paged_attention"]


@functools.partial(
    jax.jit,
    static_argnames=("backend", "interpret", "queries_per_block", "pages_per_compute_block"),
)
def _ragged_jit(
    q,
    k_pages,
    v_pages,
    page_table,
    context_lens,
    query_start_loc,
    num_seqs,
    k_scale,
    v_scale,
    layer,
    sm_scale,
    sliding_window,
    *,
    backend,
    interpret,
    queries_per_block,
    pages_per_compute_block,
):
    dims = validate_ragged(
        q,
        k_pages,
        v_pages,
        page_table,
        context_lens,
        query_start_loc,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        backend=backend,
        queries_per_block=queries_per_block,
        pages_per_compute_block=pages_per_compute_block,
        k_scale=k_scale,
        v_scale=v_scale,
        layer=layer,
    )
    if layer is None:  # one layer: the stacked form with a leading axis of 1 (a free reshape)
        k_pages, v_pages = k_pages[None], v_pages[None]
        k_scale = None if k_scale is None else k_scale[None]
        v_scale = None if v_scale is None else v_scale[None]
    ints, scale = attention_scalars(dims, layer, sm_scale, sliding_window)
    if backend == "tpu":
        from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu as impl
    else:
        from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu as impl
    return impl(
        q,
        k_pages,
        v_pages,
        page_table,
        context_lens,
        query_start_loc,
        num_seqs,
        k_scale,
        v_scale,
        ints,
        scale,
        dims=dims,
        queries_per_block=queries_per_block,
        pages_per_compute_block=pages_per_compute_block,
        interpret=interpret,
    )


def ragged_paged_attention(
    q,  # [num_tokens, num_q_heads, head_dim]
    k_pages,  # [num_layers, num_kv_heads, num_pages, page_size, head_dim] (or one layer's 4-D)
    v_pages,  # like k_pages
    page_table,  # i32[max_seqs, max_pages_per_seq]
    context_lens,  # i32[max_seqs]
    query_start_loc,  # i32[max_seqs + 1]
    num_seqs,  # i32[] | i32[1] | int
    *,
    k_scale=None,  # f32[(num_layers,) num_kv_heads, num_pages, page_size] for an int8 cache
    v_scale=None,  # like k_scale
    sm_scale=None,  # float | f32[] | None
    sliding_window=None,  # int | i32[] | None
    layer=None,  # int | i32[]: the layer of a stacked cache; None with a one-layer cache
    backend: str | None = None,
    interpret: bool = False,
    queries_per_block: int | None = None,
    pages_per_compute_block: int | None = None,
):
    """Returns [num_tokens, num_q_heads, head_dim] in q's dtype; see the module docstring."""
    backend = resolve_backend(backend, interpret, fn_name="ragged_paged_attention")
    if isinstance(num_seqs, int):
        num_seqs = jnp.asarray(num_seqs, jnp.int32)
    if isinstance(sliding_window, (int, float)) and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(
            f"ragged_paged_attention: sliding_window must be a positive int or None, got {sliding_window!r}."
        )
    return _ragged_jit(
        q,
        k_pages,
        v_pages,
        page_table,
        context_lens,
        query_start_loc,
        num_seqs,
        k_scale,
        v_scale,
        layer,
        sm_scale,
        sliding_window,
        backend=backend,
        interpret=bool(interpret),
        queries_per_block=queries_per_block,
        pages_per_compute_block=pages_per_compute_block,
    )
