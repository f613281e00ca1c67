"""Plain-JAX ragged paged attention (mixed prefill/decode batches): the ground truth for the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.reference import gather_pages
from pallas_kernels.ragged_paged_attention.plan import token_sequence
from pallas_kernels.ragged_paged_attention.validation import validate_ragged


def reference_ragged_paged_attention(
    q,  # [num_tokens, num_q_heads, head_dim]
    k_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    page_table,  # i32[max_seqs, max_pages_per_seq]
    context_lens,  # i32[max_seqs] total length incl. the new tokens
    query_start_loc,  # i32[max_seqs + 1]
    num_seqs,  # i32[] or i32[1]
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    backend: str | None = None,
    interpret: bool = False,
    queries_per_block: int | None = None,
    pages_per_compute_block: int | None = None,
):
    """Causal attention of every query row over its own sequence's cache; rows of no sequence give 0.

    Materializes [num_tokens, heads, max_pages * page_size] logits: for tests and
    small batches only.  Tuning arguments are accepted for parity and ignored.
    """
    del backend, interpret
    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    d = validate_ragged(
        q, k_pages, v_pages, page_table, context_lens, query_start_loc, num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, backend=None, queries_per_block=queries_per_block,
        pages_per_compute_block=pages_per_compute_block,
    )
    seq, valid = token_sequence(query_start_loc, num_seqs, d.max_seqs, d.num_tokens)
    t = jnp.arange(d.num_tokens, dtype=jnp.int32)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = context_lens[seq] - q_len + (t - query_start_loc[seq])  # [T]
    k = gather_pages(k_pages, page_table)[seq].astype(jnp.float32)  # [T, hkv, L, D]
    v = gather_pages(v_pages, page_table)[seq].astype(jnp.float32)
    length = k.shape[2]
    kpos = jnp.arange(length, dtype=jnp.int32)[None, :]
    allowed = valid[:, None] & (kpos <= pos[:, None]) & (kpos < context_lens[seq][:, None])
    if d.sliding_window is not None:
        allowed &= kpos > pos[:, None] - d.sliding_window
    qg = q.astype(jnp.float32).reshape(d.num_tokens, d.num_kv_heads, d.group, d.head_dim)
    logits = jnp.einsum("thgd,thld->thgl", qg, k, precision=jax.lax.Precision.HIGHEST) * d.sm_scale
    mask = allowed[:, None, None, :]
    # Select the mask and zero masked V rows: unused cache slots may be NaN.
    logits = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0.0, 1.0, l)
    v = jnp.where(allowed[:, None, :, None], v, 0.0)
    out = jnp.einsum("thgl,thld->thgd", p, v, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(q.shape).astype(q.dtype)
