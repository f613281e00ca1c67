"""The paged KV cache pytree, the per-step batch metadata, and the device ops that write pages.

Layout (documented once, shared with `pallas_kernels`): for replica r and layer l, `k[r, l]` is
`[kv_heads, num_pages, page_size, head_dim]`. The token at position p of a sequence lives in page
`page_table[p // page_size]`, slot `p % page_size`. Page ids are local to a data-parallel replica.
An int8 cache (kv_cache_dtype="int8") keeps one f32 scale per (token, KV head) beside the pages,
`k_scale[r, l]` f32[kv_heads, num_pages, page_size]: the value of a slot is int8 * scale.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.model.quant import quantize_kv
from jaxserve.model.ragged import PAD_SLOT


@flax.struct.dataclass
class KVCache:
    """K and V pages of every layer, preallocated once and donated into every step.

    Inside a step (`model.llama.forward_ragged`) the same pytree holds one replica: the leading R axis gone.
    """

    k: jax.Array  # f[R, L, K, num_pages, page_size, H], or i8 with scales
    v: jax.Array  # f[R, L, K, num_pages, page_size, H], or i8 with scales
    k_scale: jax.Array | None = None  # f32[R, L, K, num_pages, page_size]; None unless int8
    v_scale: jax.Array | None = None  # f32[R, L, K, num_pages, page_size]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

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
    def build(cls, rows, *, page_size: int, num_tokens: int, num_rows: int, max_pages: int,
              num_logits: int) -> "RaggedBatch":
        """From `ragged.RaggedRow`s (or (tokens, start, pages[, num_logits]) tuples), via the host
        packer `ragged.pack_ragged` (numpy arrays; the step moves them to the device)."""
        from jaxserve.model.ragged import RaggedRow, pack_ragged

        rows = [r if isinstance(r, RaggedRow) else RaggedRow(*r) for r in rows]
        arrays = pack_ragged(rows, page_size=page_size, num_tokens=num_tokens, num_rows=num_rows,
                             max_pages=max_pages, num_logits=num_logits)
        return cls(**{f.name: getattr(arrays, f.name) for f in dataclasses.fields(arrays)})

    @classmethod
    def stack(cls, batches: "list[RaggedBatch]") -> "RaggedBatch":
        """One batch per data-parallel replica (same shapes), stacked on a leading R axis: the layout
        of `steps.ragged`."""
        return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)


def cache_shape(cfg: ModelConfig, num_pages: int, page_size: int, num_replicas: int = 1) -> tuple[int, ...]:
    return (num_replicas, cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)


KV_CACHE_DTYPES = ("auto", "int8")


def init_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any, num_replicas: int = 1, sharding: Any = None,
    kv_cache_dtype: str = "auto", scale_sharding: Any = None,
) -> KVCache:
    """Allocate the whole cache once (zeros). Called at start-up; never again.

    kv_cache_dtype="auto" stores K/V in `dtype`; "int8" stores int8 pages plus f32 scales (on
    `scale_sharding`: `Shardings.cache_scale`)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    shape = cache_shape(cfg, num_pages, page_size, num_replicas)
    quantized = kv_cache_dtype == "int8"
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.int8 if quantized else dtype), out_shardings=sharding)
    if not quantized:
        return KVCache(k=zeros(), v=zeros())
    scale_zeros = jax.jit(lambda: jnp.zeros(shape[:-1], jnp.float32), out_shardings=scale_sharding)
    return KVCache(k=zeros(), v=zeros(), k_scale=scale_zeros(), v_scale=scale_zeros())


def cache_shardings(shardings: Any, kv_cache_dtype: str = "auto") -> KVCache:
    """The cache's pytree of shardings from a `sharding.Shardings` (the cache's layout, step to step)."""
    if kv_cache_dtype == "int8":
        return KVCache(k=shardings.cache, v=shardings.cache, k_scale=shardings.cache_scale,
                       v_scale=shardings.cache_scale)
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
    vector on the way in (absmax / 127) and scatters its scale to the same row of the scales."""
    L, K, NP, S, H = cache.k.shape
    head = jnp.arange(K, dtype=jnp.int32)[:, None]  # i32[K, 1]
    valid = (slots >= 0) & (slots < NP * S)  # bool[N]
    rows = (layer * K + head) * (NP * S) + jnp.where(valid, slots, 0)[None]  # i32[K, N]
    rows = jnp.where(valid[None], rows, L * K * NP * S)  # out of range -> dropped

    def scatter(pages, new):  # new [N, K, *rest] -> rows of pages viewed as [L*K*NP*S, *rest]
        flat = pages.reshape(L * K * NP * S, *pages.shape[4:])
        flat = flat.at[rows].set(jnp.moveaxis(new, 1, 0).astype(pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    if not cache.quantized:
        return cache.replace(k=scatter(cache.k, k_new), v=scatter(cache.v, v_new))
    (kq, ks), (vq, vs) = quantize_kv(k_new), quantize_kv(v_new)  # i8[N, K, H], f32[N, K]
    return KVCache(k=scatter(cache.k, kq), v=scatter(cache.v, vq), k_scale=scatter(cache.k_scale, ks),
                   v_scale=scatter(cache.v_scale, vs))


def copy_pages(cache: KVCache, src: jax.Array, dst: jax.Array, replica: int = 0) -> KVCache:
    """Copy whole pages (all layers and heads, and their scales) src[i] -> dst[i]: copy-on-write for
    forked sequences."""
    def copy(x):
        return None if x is None else x.at[replica, :, :, dst].set(x[replica, :, :, src])
    return KVCache(k=copy(cache.k), v=copy(cache.v), k_scale=copy(cache.k_scale), v_scale=copy(cache.v_scale))


copy_pages_jit = jax.jit(copy_pages, static_argnames=("replica",), donate_argnames=("cache",))

PADDING_PAGE = 0  # page 0 of every replica is never given to a sequence; padding rows point at it


def copy_pages_padded(cache: KVCache, replica: int, src: np.ndarray, dst: np.ndarray, width: int) -> KVCache:
    """`copy_pages_jit` over src/dst in chunks padded to `width`, so every fork reuses one compilation;
    padding copies the padding page onto itself (so an empty call compiles the copy at warm-up)."""
    for start in range(0, max(len(src), 1), width):
        s = np.full(width, PADDING_PAGE, np.int32)
        d = np.full(width, PADDING_PAGE, np.int32)
        chunk = slice(start, start + width)
        s[: len(src[chunk])], d[: len(dst[chunk])] = src[chunk], dst[chunk]
        cache = copy_pages_jit(cache, s, d, replica=replica)
    return cache
