"""Plain-JAX ragged paged attention (mixed prefill/decode batches): the ground truth for the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.plan import token_sequence
from pallas_kernels.ragged_paged_attention.validation import validate_ragged


def gather_pages(
    pages,  # [num_kv_heads, num_pages, page_size, ...] (K/V pages or their scales)
    page_table,  # i32[batch, max_pages]
):
    """Per-sequence contiguous view of a paged cache: [batch, num_kv_heads, max_pages * page_size, ...]."""
    g = pages[:, page_table]  # [kv_heads, batch, max_pages, page_size, ...]
    g = jnp.moveaxis(g, 1, 0)
    b, h, p, s = g.shape[:4]
    return g.reshape(b, h, p * s, *g.shape[4:])


def dequantize(
    pages,  # [..., tokens, head_dim] float or int8
    scale,  # f32[..., tokens] | None
):
    """f32 values of a (possibly int8) cache slice: pages * scale per token."""
    if scale is None:
        return pages.astype(jnp.float32)
    return pages.astype(jnp.float32) * scale[..., None]


def masked_softmax(
    logits,  # f32[..., keys]
    mask,  # bool[..., keys] (broadcastable) visible keys
):
    """Softmax over visible keys; a row with none gives all zeros (not NaN)."""
    # Masked slots may hold NaN/garbage: select (not add) the mask.
    logits = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(l == 0.0, 1.0, l)


def reference_ragged_paged_attention(
    q,  # [num_tokens, num_q_heads, head_dim]
    k_pages,  # [num_layers, num_kv_heads, num_pages, page_size, head_dim] (or one layer's 4-D)
    v_pages,  # like k_pages
    page_table,  # i32[max_seqs, max_pages_per_seq]
    context_lens,  # i32[max_seqs] total length incl. the new tokens
    query_start_loc,  # i32[max_seqs + 1]
    num_seqs,  # i32[] or i32[1]
    *,
    k_scale=None,  # f32[(num_layers,) num_kv_heads, num_pages, page_size] | None (int8 cache)
    v_scale=None,  # like k_scale
    sm_scale=None,  # float | f32[] | None
    sliding_window=None,  # int | i32[] | None
    layer=None,  # int | i32[]: the layer of a stacked cache; None with a one-layer cache
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
        q,
        k_pages,
        v_pages,
        page_table,
        context_lens,
        query_start_loc,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        backend=None,
        queries_per_block=queries_per_block,
        pages_per_compute_block=pages_per_compute_block,
        k_scale=k_scale,
        v_scale=v_scale,
        layer=layer,
    )
    if layer is not None:  # the ground truth may slice: the kernels are the ones that must not
        k_pages, v_pages = k_pages[layer], v_pages[layer]
        k_scale = None if k_scale is None else k_scale[layer]
        v_scale = None if v_scale is None else v_scale[layer]
    sm_scale = d.head_dim**-0.5 if sm_scale is None else sm_scale
    seq, valid = token_sequence(query_start_loc, num_seqs, d.max_seqs, d.num_tokens)
    t = jnp.arange(d.num_tokens, dtype=jnp.int32)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = context_lens[seq] - q_len + (t - query_start_loc[seq])  # [T]

    def per_token(pages, scale):  # f32[T, hkv, L, D]: each query row's sequence, dequantized
        pages = gather_pages(pages, page_table)[seq]
        return dequantize(pages, None if scale is None else gather_pages(scale, page_table)[seq])

    k = per_token(k_pages, k_scale)
    v = per_token(v_pages, v_scale)
    length = k.shape[2]
    kpos = jnp.arange(length, dtype=jnp.int32)[None, :]
    allowed = valid[:, None] & (kpos <= pos[:, None]) & (kpos < context_lens[seq][:, None])
    if sliding_window is not None:
        allowed &= kpos > pos[:, None] - sliding_window
    qg = q.astype(jnp.float32).reshape(d.num_tokens, d.num_kv_heads, d.group, d.head_dim)
    logits = jnp.einsum("thgd,thld->thgl", qg, k, precision=jax.lax.Precision.HIGHEST) * sm_scale
    p = masked_softmax(logits, allowed[:, None, None, :])
    v = jnp.where(allowed[:, None, :, None], v, 0.0)  # unused cache slots may be NaN: 0 * NaN = NaN
    out = jnp.einsum("thgl,thld->thgd", p, v, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(q.shape).astype(q.dtype)
