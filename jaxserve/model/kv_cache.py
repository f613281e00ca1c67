"""The paged KV cache pytree, the per-step batch metadata, and the device ops that write pages.

Layout (documented once, shared with `pallas_kernels`): for replica r and layer l, `k[r, l]` is
`[kv_heads, num_pages, page_size, head_dim]`. The token at position p of a sequence lives in page
`page_table[p // page_size]`, slot `p % page_size`. Page ids are local to a data-parallel replica.
An int8 cache (kv_cache_dtype="int8") keeps one f32 scale per (token, KV head) beside the pages,
`k_scale[r, l]` f32[kv_heads, num_pages, page_size]: the value of a slot is int8 * scale.
A float8 cache (kv_cache_dtype="fp8" = "fp8_e4m3", or "fp8_e5m2", vLLM's) keeps one f32 scale per
layer and KV head, `k_scale[r, l]` f32[kv_heads, 1, 1] (vLLM's per-layer scale on every head: 1.0
unless the checkpoint gives k_scale / v_scale): a slot holds x / scale saturated to the format's
range, and its value is float8 * scale. The scales have the int8 scales' rank, so both take
`Shardings.cache_scale` (the KV-head axis split like the pages').

This module is the one place that says how K/V are stored (`write_kv_slots`) and read (`attend`):
the attention paths widen int8 and float8 pages to q's dtype and apply int8's per-slot scales
themselves; they never see a float8 cache's scales, which `attend` folds into q (K's: q.(k*s) =
(q*s).k) and into the output (V's: sum p*(v*s) = (sum p*v)*s), each a scalar per KV head.
Float8 pages move (scatter, gather, page copies) as bytes (`as_bytes`): XLA:CPU has no float8
gather or scatter and widens the whole operand, the whole cache, to f16 around each one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.config.engine_config import KV_CACHE_DTYPES
from jaxserve.model.quant import quantize_kv
from jaxserve.model.ragged import PAD_SLOT


@flax.struct.dataclass
class KVCache:
    """K and V pages of every layer, preallocated once and donated into every step.

    Inside a step (`model.llama.forward_ragged`) the same pytree holds one replica: the leading R axis gone.
    """

    k: jax.Array  # f[R, L, K, num_pages, page_size, H], or i8 / float8 with scales
    v: jax.Array  # f[R, L, K, num_pages, page_size, H], or i8 / float8 with scales
    k_scale: jax.Array | None = None  # int8: f32[R, L, K, num_pages, page_size]; float8: f32[R, L, K, 1, 1]
    v_scale: jax.Array | None = None  # like k_scale

    @property
    def quantized(self) -> bool:
        """Pages with scales: int8 (a scale per slot, which every attention path applies itself) or
        float8 (a scale per layer and KV head, which `attend` applies). Both take the same shardings."""
        return self.k_scale is not None

    @property
    def fp8(self) -> bool:
        return is_fp8(self.k.dtype)

    @property
    def kv_cache_dtype(self) -> str:
        """The setting this cache was made for (`cache_shardings` takes it): auto, int8, fp8_e4m3, fp8_e5m2."""
        if self.k.dtype == jnp.int8:
            return "int8"
        return {jnp.dtype(d): name for name, d in FP8_DTYPES.items()}.get(self.k.dtype, "auto")

    @property
    def num_replicas(self) -> int:
        return self.k.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k.shape[3]

    @property
    def page_size(self) -> int:
        return self.k.shape[4]


@flax.struct.dataclass
class StepBatch:
    """Rows of a research step as a rectangle: a chunk of T tokens for each of B sequences in each
    of R replicas (`steps.prefill` / `steps.decode`, which lay them out as a `RaggedBatch` on the
    device: the form to build by hand, when every row is a prompt or every row a decode).

    Decode is T == 1. Rows with num_new == 0 are padding: they write nothing and their logits are
    ignored. Static values live in shapes; everything that varies per request is an array, so one
    compiled step serves every request that fits its bucket.
    """

    tokens: jax.Array  # i32[R, B, T]
    start_pos: jax.Array  # i32[R, B]  tokens already in the cache before this chunk
    num_new: jax.Array  # i32[R, B]  valid tokens of this chunk (<= T)
    page_table: jax.Array  # i32[R, B, P]

    @classmethod
    def build(
        cls,
        tokens: list[list[int]],
        start_pos: list[int],
        page_tables: list[list[int]],
        chunk: int | None = None,
        max_pages: int | None = None,
    ) -> "StepBatch":
        """One replica's batch from Python lists, padded to `chunk` tokens and `max_pages` pages.

        Keep `chunk` and `max_pages` fixed across calls so every step reuses one compilation.
        """
        T = chunk or max(len(t) for t in tokens)
        P = max_pages or max(len(p) for p in page_tables)
        tok = np.zeros((1, len(tokens), T), np.int32)
        table = np.zeros((1, len(tokens), P), np.int32)
        for b, (t, p) in enumerate(zip(tokens, page_tables)):
            tok[0, b, : len(t)] = t
            table[0, b, : len(p)] = p
        return cls(
            tokens=tok,
            start_pos=np.asarray([start_pos], np.int32),
            num_new=np.asarray([[len(t) for t in tokens]], np.int32),
            page_table=table,
        )


@flax.struct.dataclass
class RaggedBatch:
    """One replica's step as a flat ragged batch: N tokens of S rows (prompt chunks, decodes and
    verifications mixed), each row's tokens contiguous and rows in order (`jaxserve.model.ragged`).

    N is a token-budget bucket (powers of two up to max_num_batched_tokens); S rows, P pages per
    row and L logits are fixed per engine. Padding tokens (after the last row) write nothing (slot
    out of range) and attend to nothing; padding rows have no tokens and context 0.
    """

    tokens: jax.Array  # i32[N]
    positions: jax.Array  # i32[N]  position of each token in its sequence
    slots: jax.Array  # i32[N]  page * page_size + offset where its K/V goes; ragged.PAD_SLOT (-1) for padding
    token_row: jax.Array  # i32[N]  row of each token; S for padding tokens
    query_start: jax.Array  # i32[S+1]  row r's tokens are [query_start[r], query_start[r+1])
    context_lens: jax.Array  # i32[S]  tokens in the cache for each row after this step's writes
    page_table: jax.Array  # i32[S, P]
    logit_index: jax.Array  # i32[L]  tokens whose logits are returned, row by row; padding -> 0 (ignored)
    # With LoRA adapters (model/lora.py): each row's device slot, -1 for the base model; None when the
    # engine serves no adapters (the step then has no such input).
    row_lora: jax.Array | None = None  # i32[S]

    @classmethod
    def build(
        cls, rows, *, page_size: int, num_tokens: int, num_rows: int, max_pages: int, num_logits: int
    ) -> "RaggedBatch":
        """From `ragged.RaggedRow`s (or (tokens, start, pages[, num_logits]) tuples), via the host
        packer `ragged.pack_ragged` (numpy arrays; the step moves them to the device)."""
        from jaxserve.model.ragged import RaggedRow, pack_ragged

        rows = [r if isinstance(r, RaggedRow) else RaggedRow(*r) for r in rows]
        arrays = pack_ragged(
            rows,
            page_size=page_size,
            num_tokens=num_tokens,
            num_rows=num_rows,
            max_pages=max_pages,
            num_logits=num_logits,
        )
        return cls(**{f.name: getattr(arrays, f.name) for f in dataclasses.fields(arrays)})

    @classmethod
    def stack(cls, batches: "list[RaggedBatch]") -> "RaggedBatch":
        """One batch per data-parallel replica (same shapes), stacked on a leading R axis: the layout
        of `steps.ragged`."""
        return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)


def cache_shape(cfg: ModelConfig, num_pages: int, page_size: int, num_replicas: int = 1) -> tuple[int, ...]:
    return (num_replicas, cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)


# kv_cache_dtype -> the float8 format of the pages (vLLM's names; "fp8" is E4M3, the OCP "fn" variant
# without infinities, as vLLM's CUDA caches store it).
FP8_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def init_cache(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: Any,
    num_replicas: int = 1,
    sharding: Any = None,
    kv_cache_dtype: str = "auto",
    scale_sharding: Any = None,
    kv_scales: tuple[Any, Any] | None = None,
) -> KVCache:
    """Allocate the whole cache once (zeros). Called at start-up; never again.

    kv_cache_dtype="auto" stores K/V in `dtype`; "int8" stores int8 pages plus f32 scales per slot (on
    `scale_sharding`: `Shardings.cache_scale`); "fp8" / "fp8_e4m3" / "fp8_e5m2" float8 pages plus f32
    scales per layer and KV head, f32[R, L, K, 1, 1] (on `scale_sharding` too): `kv_scales` (k, v),
    each f32[L] or f32[L, K] (the checkpoint's k_scale / v_scale, `loading.kv_scales`), else 1.0."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_scales is not None and kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"per-layer kv_scales are for a float8 cache, not kv_cache_dtype={kv_cache_dtype!r}")
    shape = cache_shape(cfg, num_pages, page_size, num_replicas)
    page_dtype = jnp.int8 if kv_cache_dtype == "int8" else FP8_DTYPES.get(kv_cache_dtype, dtype)
    zeros = jax.jit(lambda: jnp.zeros(shape, page_dtype), out_shardings=sharding)
    if kv_cache_dtype == "int8":
        scale_zeros = jax.jit(lambda: jnp.zeros(shape[:-1], jnp.float32), out_shardings=scale_sharding)
        return KVCache(k=zeros(), v=zeros(), k_scale=scale_zeros(), v_scale=scale_zeros())
    if kv_cache_dtype not in FP8_DTYPES:
        return KVCache(k=zeros(), v=zeros())
    L, K = cfg.num_layers, cfg.num_kv_heads
    scales = []
    for name, s in zip(("k_scale", "v_scale"), (None, None) if kv_scales is None else kv_scales):
        s = np.ones((L, K), np.float32) if s is None else np.asarray(s, np.float32)
        s = np.broadcast_to(s[:, None] if s.shape == (L,) else s, (L, K)) if s.shape in ((L,), (L, K)) else s
        if s.shape != (L, K) or not np.all(np.isfinite(s) & (s > 0)):
            raise ValueError(
                f"{name} must be positive finite scales per layer [{L}] or per layer and KV head "
                f"[{L}, {K}], got shape {s.shape}"
            )
        scales.append(np.ascontiguousarray(s))
    per_replica = jax.jit(
        lambda s: jnp.tile(s[None, :, :, None, None], (num_replicas, 1, 1, 1, 1)), out_shardings=scale_sharding
    )
    return KVCache(k=zeros(), v=zeros(), k_scale=per_replica(scales[0]), v_scale=per_replica(scales[1]))


def cache_shardings(shardings: Any, kv_cache_dtype: str = "auto") -> KVCache:
    """The cache's pytree of shardings from a `sharding.Shardings` (the cache's layout, step to step).
    Any cache with scales (`KVCache.quantized`: int8, or float8 under any of its names) takes
    `Shardings.cache_scale` for them: int8's f32[R, L, K, NP, S] and float8's f32[R, L, K, 1, 1] are
    split alike (replicas on `data`, KV heads on `model`)."""
    if kv_cache_dtype == "int8" or kv_cache_dtype in FP8_DTYPES:
        return KVCache(
            k=shardings.cache, v=shardings.cache, k_scale=shardings.cache_scale, v_scale=shardings.cache_scale
        )
    return KVCache(k=shardings.cache, v=shardings.cache)


def write_kv(
    cache: KVCache,  # one replica: k, v f[L, K, NP, S, H] (i8 with k_scale, v_scale f32[L, K, NP, S])
    layer: jax.Array | int,
    k_new: jax.Array,  # f[B, T, K, H]
    v_new: jax.Array,  # f[B, T, K, H]
    page_table: jax.Array,  # i32[B, P]
    positions: jax.Array,  # i32[B, T]
    valid: jax.Array,  # bool[B, T]
) -> KVCache:
    """`write_kv_slots` for tokens given as rows of a rectangle: each valid token's slot from its
    row's page table; invalid (padding) tokens are dropped, not written."""
    B, T = positions.shape
    S = cache.k.shape[3]
    page = jnp.take_along_axis(page_table, positions // S, axis=1, mode="clip")  # i32[B, T]
    slots = jnp.where(valid, page * S + positions % S, PAD_SLOT).reshape(B * T)
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    return write_kv_slots(cache, layer, flat(k_new), flat(v_new), slots)


def write_kv_slots(
    cache: KVCache,  # one replica: k, v f[L, K, NP, S, H] (i8 with k_scale, v_scale f32[L, K, NP, S])
    layer: jax.Array | int,
    k_new: jax.Array,  # f[N, K, H]
    v_new: jax.Array,  # f[N, K, H]
    slots: jax.Array,  # i32[N]  page * page_size + offset; outside [0, NP * S) = dropped (padding)
) -> KVCache:
    """Scatter a step's K/V into its pages by slot (`RaggedBatch.slots`).

    The cache is viewed as rows of head_dim so one scatter handles every head: flattening a donated
    buffer is free, and the scatter updates it in place. An int8 cache quantizes each (token, head)
    vector on the way in (absmax / 127) and scatters its scale to the same row of the scales; a float8
    cache stores x / the layer's scale, saturated to the format's largest finite value (as vLLM's
    caches convert), in f32 before the one rounding to float8."""
    L, K, NP, S, H = cache.k.shape
    head = jnp.arange(K, dtype=jnp.int32)[:, None]  # i32[K, 1]
    valid = (slots >= 0) & (slots < NP * S)  # bool[N]
    rows = (layer * K + head) * (NP * S) + jnp.where(valid, slots, 0)[None]  # i32[K, N]
    rows = jnp.where(valid[None], rows, L * K * NP * S)  # out of range -> dropped

    def scatter(pages, new):  # new [N, K, *rest] -> rows of pages viewed as [L*K*NP*S, *rest]
        flat = as_bytes(pages).reshape(L * K * NP * S, *pages.shape[4:])
        flat = flat.at[rows].set(as_bytes(jnp.moveaxis(new, 1, 0).astype(pages.dtype)), mode="drop")
        return from_bytes(flat.reshape(pages.shape), pages.dtype)

    if cache.fp8:
        return cache.replace(
            k=scatter(cache.k, _to_fp8(k_new, _head_scales(cache.k_scale, layer), cache.k.dtype)),
            v=scatter(cache.v, _to_fp8(v_new, _head_scales(cache.v_scale, layer), cache.v.dtype)),
        )
    if not cache.quantized:
        return cache.replace(k=scatter(cache.k, k_new), v=scatter(cache.v, v_new))
    (kq, ks), (vq, vs) = quantize_kv(k_new), quantize_kv(v_new)  # i8[N, K, H], f32[N, K]
    return KVCache(
        k=scatter(cache.k, kq),
        v=scatter(cache.v, vq),
        k_scale=scatter(cache.k_scale, ks),
        v_scale=scatter(cache.v_scale, vs),
    )


def is_fp8(dtype: Any) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def as_bytes(x: jax.Array) -> jax.Array:
    """Float8 pages as uint8 (a free bitcast), anything else as it is: what gathers, scatters and page
    copies move. XLA:CPU (jax 0.10) runs a float8 gather or scatter in f16, converting its whole operand
    there and back: on the cache, every layer of every step (docs/BENCHMARKS.md, "fp8 KV cache")."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8) if is_fp8(x.dtype) else x


def from_bytes(x: jax.Array, dtype: Any) -> jax.Array:
    """`as_bytes` undone: uint8 back to the float8 `dtype`."""
    return jax.lax.bitcast_convert_type(x, dtype) if is_fp8(dtype) else x


def _head_scales(scale: jax.Array, layer: jax.Array | int) -> jax.Array:
    """A float8 cache's scales f32[L, K, 1, 1] -> layer `layer`'s f32[K]."""
    return scale[layer][:, 0, 0]


def _to_fp8(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """x f[N, K, H] / scale f32[K] in `dtype` (float8), in f32 then one rounding, saturated as vLLM's
    caches convert: E4M3 has no infinity (out of range would be NaN), and E5M2's would poison the softmax."""
    big = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale[:, None], -big, big).astype(dtype)


def attend(
    attention: Any,
    q: jax.Array,
    cache: KVCache,
    layer: jax.Array | int,
    batch: RaggedBatch,
    window: jax.Array,
    sm_scale: jax.Array,
) -> jax.Array:
    """`attention` (`llama.RaggedAttentionFn`) of q f[N, heads, H] over one replica's cache at `layer`,
    read as the cache stores it: int8 pages with their per-slot scales, which the attention applies;
    float8 pages with each KV head's K scale multiplied into its query heads and its V scale into their
    outputs, in f32 (q.(k*s) = (q*s).k; sum p*(v*s) = (sum p*v)*s): every attention path (the blocked
    reference, the Pallas kernels, per shard under shard_map) sees scale-free float8 pages."""
    if not cache.fp8:
        kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale) if cache.quantized else {}
        return attention(
            q,
            cache.k,
            cache.v,
            layer,
            batch.positions,
            batch.query_start,
            batch.context_lens,
            batch.page_table,
            window,
            sm_scale,
            **kw,
        )
    group = q.shape[1] // cache.k.shape[1]

    def per_head(x, scale):  # x f[N, heads, H] times its KV head's scale, in f32
        return (x.astype(jnp.float32) * jnp.repeat(_head_scales(scale, layer), group)[:, None]).astype(x.dtype)

    out = attention(
        per_head(q, cache.k_scale),
        cache.k,
        cache.v,
        layer,
        batch.positions,
        batch.query_start,
        batch.context_lens,
        batch.page_table,
        window,
        sm_scale,
    )
    return per_head(out, cache.v_scale)


def copy_pages(cache: KVCache, src: jax.Array, dst: jax.Array, replica: int = 0) -> KVCache:
    """Copy whole pages (all layers and heads, and an int8 cache's scales) src[i] -> dst[i]:
    copy-on-write for forked sequences. A float8 cache's per-layer scales stay as they are."""

    def copy(x):
        b = as_bytes(x)
        return from_bytes(b.at[replica, :, :, dst].set(b[replica, :, :, src]), x.dtype)

    if not cache.quantized or cache.fp8:
        return cache.replace(k=copy(cache.k), v=copy(cache.v))
    return KVCache(k=copy(cache.k), v=copy(cache.v), k_scale=copy(cache.k_scale), v_scale=copy(cache.v_scale))


copy_pages_jit = jax.jit(copy_pages, static_argnames=("replica",), donate_argnames=("cache",))

PADDING_PAGE = 0  # page 0 of every replica is never given to a sequence; padding rows point at it


def padded_page_chunks(src: np.ndarray, dst: np.ndarray, width: int):
    """(src, dst) page ids i32[width] in chunks, the last padded with the padding page (copied onto
    itself), so every copy reuses one compilation; one chunk of padding for an empty copy (so that it
    compiles at warm-up)."""
    for start in range(0, max(len(src), 1), width):
        s = np.full(width, PADDING_PAGE, np.int32)
        d = np.full(width, PADDING_PAGE, np.int32)
        chunk = slice(start, start + width)
        s[: len(src[chunk])], d[: len(dst[chunk])] = src[chunk], dst[chunk]
        yield s, d


def copy_pages_padded(cache: KVCache, replica: int, src: np.ndarray, dst: np.ndarray, width: int) -> KVCache:
    """`copy_pages_jit` over src/dst in `padded_page_chunks`."""
    for s, d in padded_page_chunks(src, dst, width):
        cache = copy_pages_jit(cache, s, d, replica=replica)
    return cache
