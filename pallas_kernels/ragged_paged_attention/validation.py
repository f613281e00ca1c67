"""Trace-time checks of ragged paged-attention inputs (shapes, dtypes, head ratio, backend alignment)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_float_dtype, check_int32, is_pow2, tpu_sublane_tile

FN = "ragged_paged_attention"
# float8 pages (vLLM's fp8 KV cache) are read as their values, widened to q's dtype; a per-tensor scale
# is the caller's to fold into q (or sm_scale) and the output (jaxserve.model.kv_cache.attend does).
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


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
    num_layers: int  # layers of the stacked cache the kernel receives (1 for a one-layer cache)
    quantized: bool = False  # int8 pages with f32 scales [(num_layers,) num_kv_heads, num_pages, page_size]
    fp8: bool = False  # float8 pages (no scales: widened to q's dtype as they are)


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
        raise ValueError(
            f"{fn}: an int8 KV cache needs k_scale and v_scale ([num_kv_heads, num_pages, page_size] f32)."
        )
    if not quantized and k_scale is not None:
        raise ValueError(f"{fn}: k_scale/v_scale are only valid with an int8 KV cache, got {k_pages.dtype} pages.")
    if not quantized and jnp.dtype(k_pages.dtype) not in FP8_DTYPES:
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


def validate_ragged(
    q,  # [num_tokens, num_q_heads, head_dim]
    k_pages,  # [num_layers, num_kv_heads, num_pages, page_size, head_dim] with layer, or one layer's 4-D
    v_pages,  # like k_pages
    page_table,  # i32[max_seqs, max_pages]
    context_lens,  # i32[max_seqs]
    query_start_loc,  # i32[max_seqs + 1]
    num_seqs,  # i32[] | i32[1]
    *,
    sm_scale,  # float | f32[] | None
    sliding_window,  # int | i32[] | None
    backend: str | None,
    queries_per_block: int | None,
    pages_per_compute_block: int | None,
    k_scale=None,  # f32[(num_layers,) num_kv_heads, num_pages, page_size] | None (int8 cache)
    v_scale=None,  # like k_scale
    layer=None,  # i32[] | int: the layer of a 5-D (stacked) cache; None with a 4-D (one-layer) cache
) -> RaggedDims:
    fn = FN
    if q.ndim != 3:
        raise ValueError(f"{fn}: q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}.")
    check_float_dtype("q", q, fn)
    num_layers = 1
    if layer is not None:
        if k_pages.ndim != 5:
            raise ValueError(
                f"{fn}: with a layer index k_pages must be the stacked cache "
                f"[num_layers, num_kv_heads, num_pages, page_size, head_dim], got shape {k_pages.shape}."
            )
        if jnp.shape(layer) not in ((), (1,)):
            raise ValueError(f"{fn}: layer must be an int32 scalar, got shape {jnp.shape(layer)}.")
        if not isinstance(layer, int):
            check_int32("layer", layer, fn)
        num_layers = k_pages.shape[0]
        # The per-layer checks below see one layer's shapes.
        one = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)  # noqa: E731
        k_pages, v_pages, k_scale, v_scale = one(k_pages), one(v_pages), one(k_scale), one(v_scale)
    elif k_pages.ndim == 5:
        raise ValueError(f"{fn}: a stacked (5-D) cache needs layer=, the index of the layer to attend over.")
    quantized = validate_kv_cache(k_pages, v_pages, k_scale, v_scale, fn=fn)
    fp8 = jnp.dtype(k_pages.dtype) in FP8_DTYPES
    if not quantized and not fp8 and k_pages.dtype != q.dtype:
        raise ValueError(
            f"{fn}: k_pages/v_pages dtype {k_pages.dtype} must equal q dtype {q.dtype} "
            "(or be int8 with scales, or float8)."
        )
    validate_heads(q, k_pages, fn=fn)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    if page_table.ndim != 2 or page_table.shape[1] < 1:
        raise ValueError(f"{fn}: page_table must be [max_seqs, max_pages_per_seq], got {page_table.shape}.")
    check_int32("page_table", page_table, fn)
    max_seqs = page_table.shape[0]
    if context_lens.shape != (max_seqs,):
        raise ValueError(
            f"{fn}: context_lens must have shape ({max_seqs},) like page_table rows, got {context_lens.shape}."
        )
    check_int32("context_lens", context_lens, fn)
    if query_start_loc.shape != (max_seqs + 1,):
        raise ValueError(f"{fn}: query_start_loc must have shape ({max_seqs + 1},), got {query_start_loc.shape}.")
    check_int32("query_start_loc", query_start_loc, fn)
    if num_seqs.shape not in ((), (1,)):
        raise ValueError(f"{fn}: num_seqs must be an int32 scalar or shape (1,), got shape {num_seqs.shape}.")
    check_int32("num_seqs", num_seqs, fn)
    if isinstance(sliding_window, (int, float)) and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"{fn}: sliding_window must be a positive int or None, got {sliding_window!r}.")
    validate_block_sizes(
        backend, fn=fn, queries_per_block=queries_per_block, pages_per_compute_block=pages_per_compute_block
    )
    if backend is not None:
        validate_backend_layout(
            backend, page_size=page_size, head_dim=head_dim, kv_dtype=k_pages.dtype, q_dtype=q.dtype, fn=fn
        )
    for name, x in (("sm_scale", sm_scale), ("sliding_window", sliding_window)):
        if x is not None and jnp.shape(x) not in ((), (1,)):
            raise ValueError(
                f"{fn}: {name} must be a scalar (a number or a traced 0-d array), got shape {jnp.shape(x)}."
            )
    return RaggedDims(
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        group=num_q_heads // num_kv_heads,
        head_dim=head_dim,
        num_pages=num_pages,
        page_size=page_size,
        max_seqs=max_seqs,
        max_pages=page_table.shape[1],
        num_layers=num_layers,
        quantized=quantized,
        fp8=fp8,
    )


def attention_scalars(
    dims: RaggedDims,
    layer,  # i32[] | int | None
    sm_scale,  # f32[] | float | None
    sliding_window,  # i32[] | int | None
):
    """The per-call scalars every kernel takes as operands: (layer, window) i32[2] and sm_scale f32[1].

    Operands, not compile-time constants, so one compiled kernel serves every layer of a scanned
    step (Gemma 3-style layers differ in window and scale). No window (None) and windows wider than
    a row can hold are clamped to max_pages * page_size: they mask nothing, and `(key - p0 +
    window) * group` in the kernels' masks cannot overflow int32. The layer is clamped into the
    stack (defensively, as context lengths are: an index past it would read outside the cache)."""
    max_ctx = dims.max_pages * dims.page_size
    window = max_ctx if sliding_window is None else sliding_window
    window = jnp.clip(jnp.reshape(jnp.asarray(window), ()).astype(jnp.int32), 1, max_ctx)
    layer = jnp.clip(jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), ()), 0, dims.num_layers - 1)
    scale = dims.head_dim**-0.5 if sm_scale is None else sm_scale
    scale = jnp.reshape(jnp.asarray(scale, jnp.float32), (1,))
    return jnp.stack([layer, window]), scale
