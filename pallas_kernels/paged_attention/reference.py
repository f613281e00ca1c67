"""Plain-JAX paged decode attention: the ground truth the kernels are tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import pad_axis
from pallas_kernels.paged_attention.validation import validate_paged_attention


def gather_pages(
    pages,  # [num_kv_heads, num_pages, page_size, ...] (K/V pages or their scales)
    page_table,  # i32[batch, max_pages]
):
    """Per-sequence contiguous view of a paged cache: [batch, num_kv_heads, max_pages * page_size, ...]."""
    g = pages[:, page_table]  # [kv_heads, batch, max_pages, page_size, ...]
    g = jnp.moveaxis(g, 1, 0)
    b, h, p, s = g.shape[:4]
    return g.reshape(b, h, p * s, *g.shape[4:])


def group_queries(
    q,  # [batch, num_q_heads, head_dim]
    num_kv_heads: int,
    group_padded: int,
):
    """[batch, num_kv_heads, group_padded, head_dim]: the query heads of each KV head, zero rows appended
    (the kernels' query tile); `ungroup_outputs` undoes it."""
    batch, num_q_heads, head_dim = q.shape
    return pad_axis(q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim), 2, group_padded)


def ungroup_outputs(
    out,  # [batch, num_kv_heads, group_padded, head_dim]
    group: int,
):
    batch, num_kv_heads, _, head_dim = out.shape
    return out[:, :, :group].reshape(batch, num_kv_heads * group, head_dim)


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


def reference_paged_attention(
    q,  # [batch, num_q_heads, head_dim]
    k_pages,  # [num_kv_heads, num_pages, page_size, head_dim] (float, or int8 with scales)
    v_pages,  # [num_kv_heads, num_pages, page_size, head_dim]
    seq_lens,  # i32[batch]
    page_table,  # i32[batch, max_pages_per_seq]
    *,
    k_scale=None,  # f32[num_kv_heads, num_pages, page_size] | None
    v_scale=None,  # f32[num_kv_heads, num_pages, page_size] | None
    sm_scale: float | None = None,
    backend: str | None = None,
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
):
    """Decode attention of each sequence's last token over its first seq_lens[b] cached tokens.

    `backend`, `interpret` and `pages_per_compute_block` are accepted for signature
    parity with `paged_attention` and ignored (only validated).
    """
    del interpret
    d = validate_paged_attention(
        q, k_pages, v_pages, seq_lens, page_table, k_scale, v_scale, sm_scale, None, pages_per_compute_block
    )
    del backend
    k = gather_pages(k_pages, page_table)  # [b, hkv, t, d]
    v = gather_pages(v_pages, page_table)
    ks = None if k_scale is None else gather_pages(k_scale, page_table)  # [b, hkv, t]
    vs = None if v_scale is None else gather_pages(v_scale, page_table)
    k = dequantize(k, ks)
    v = dequantize(v, vs)
    t = k.shape[2]
    qg = q.astype(jnp.float32).reshape(d.batch, d.num_kv_heads, d.group, d.head_dim)
    logits = jnp.einsum("bhgd,bhtd->bhgt", qg, k, precision=jax.lax.Precision.HIGHEST) * d.sm_scale
    valid = jnp.arange(t)[None, :] < seq_lens[:, None]  # [b, t]
    p = masked_softmax(logits, valid[:, None, None, :])  # seq_len 0 -> all-zero output
    v = jnp.where(valid[:, None, :, None], v, 0.0)  # masked V rows too: 0 * NaN = NaN in the value matmul
    out = jnp.einsum("bhgt,bhtd->bhgd", p, v, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(q.shape).astype(q.dtype)
