"""Paged decode attention: one query token per sequence against its paged KV cache (TPU Mosaic or GPU Triton)."""

# Cache layout (one layer): k_pages, v_pages [num_kv_heads, num_pages, page_size, head_dim];
# token p of sequence b lives in page page_table[b, p // page_size], slot p % page_size.
# Query head h reads KV head h // (num_q_heads // num_kv_heads).  An int8 cache comes
# with per-token-per-head f32 scales [num_kv_heads, num_pages, page_size]
# (value = int8 * scale).  A sequence with seq_len 0 yields zeros.

from __future__ import annotations

import functools

import jax

from pallas_kernels._common import resolve_backend
from pallas_kernels.paged_attention.reference import reference_paged_attention
from pallas_kernels.paged_attention.validation import validate_paged_attention

__all__ = ["paged_attention", "reference_paged_attention"]


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "backend", "interpret", "pages_per_compute_block")
)
def _paged_attention_jit(q, k_pages, v_pages, seq_lens, page_table, k_scale, v_scale, *, sm_scale, backend,
                         interpret, pages_per_compute_block):
    dims = validate_paged_attention(
        q, k_pages, v_pages, seq_lens, page_table, k_scale, v_scale, sm_scale, backend, pages_per_compute_block
    )
    if backend == "tpu":
        from pallas_kernels.paged_attention.tpu import paged_attention_tpu

        return paged_attention_tpu(
            q, k_pages, v_pages, seq_lens, page_table, k_scale, v_scale, dims=dims,
            pages_per_compute_block=pages_per_compute_block, interpret=interpret,
        )
    from pallas_kernels.paged_attention.gpu import paged_attention_gpu

    return paged_attention_gpu(
        q, k_pages, v_pages, seq_lens, page_table, k_scale, v_scale, dims=dims,
        pages_per_compute_block=pages_per_compute_block, interpret=interpret,
    )


def paged_attention(
    q,  # [batch, num_q_heads, head_dim] f32/bf16/f16
    k_pages,  # [num_kv_heads, num_pages, page_size, head_dim], q's dtype or int8
    v_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    seq_lens,  # i32[batch] valid tokens per sequence (query = last of them)
    page_table,  # i32[batch, max_pages_per_seq]
    *,
    k_scale=None,  # f32[num_kv_heads, num_pages, page_size] for an int8 cache
    v_scale=None,  # f32[num_kv_heads, num_pages, page_size] for an int8 cache
    sm_scale: float | None = None,  # default head_dim ** -0.5
    backend: str | None = None,  # "tpu" | "gpu" | None (from jax.default_backend())
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
):
    """Decode attention of each sequence's last token over its first seq_lens[b] cached tokens.

    Returns [batch, num_q_heads, head_dim] in q's dtype (zeros where seq_lens[b] == 0).
    Token p of sequence b is page_table[b, p // page_size], slot p % page_size; query
    head h reads KV head h // (num_q_heads // num_kv_heads).  With an int8 cache the
    value of a slot is int8 * scale[kv_head, page, slot].  On CPU pass backend="tpu" or
    "gpu" with interpret=True (or call reference_paged_attention).
    """
    backend = resolve_backend(backend, interpret, fn_name="paged_attention")
    return _paged_attention_jit(
        q, k_pages, v_pages, seq_lens, page_table, k_scale, v_scale,
        sm_scale=None if sm_scale is None else float(sm_scale), backend=backend, interpret=bool(interpret),
        pages_per_compute_block=pages_per_compute_block,
    )
