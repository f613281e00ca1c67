"""The paged KV cache pytree, the per-step batch metadata, and the device ops that write pages.

Layout (documented once, shared with `pallas_kernels`): for replica r and layer l, `k[r, l]` is
`[kv_heads, num_pages, page_size, head_dim]`. The token at position p of a sequence lives in page
`page_table[p // page_size]`, slot `p % page_size`. Page ids are local to a data-parallel replica.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    """K and V pages of every layer, preallocated once and donated into every step."""

    k: jax.Array  # f[R, L, K, num_pages, page_size, H]
    v: jax.Array  # f[R, L, K, num_pages, page_size, H]

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
    """What one step computes: a chunk of T tokens for each of B sequences in each of R replicas.

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

    @property
    def positions(self) -> jax.Array:  # i32[R, B, T]
        return self.start_pos[..., None] + jnp.arange(self.tokens.shape[-1], dtype=jnp.int32)

    @property
    def seq_lens(self) -> jax.Array:  # i32[R, B]  length after this chunk is written
        return self.start_pos + self.num_new


def cache_shape(cfg: ModelConfig, num_pages: int, page_size: int, num_replicas: int = 1) -> tuple[int, ...]:
    return (num_replicas, cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)


def init_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any, num_replicas: int = 1, sharding: Any = None
) -> KVCache:
    """Allocate the whole cache once (zeros). Called at start-up; never again."""
    shape = cache_shape(cfg, num_pages, page_size, num_replicas)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return KVCache(k=zeros(), v=zeros())


def write_kv(
    k_cache: jax.Array,  # f[L, K, NP, S, H]  (one replica)
    v_cache: jax.Array,  # f[L, K, NP, S, H]
    layer: jax.Array | int,
    k_new: jax.Array,  # f[B, T, K, H]
    v_new: jax.Array,  # f[B, T, K, H]
    page_table: jax.Array,  # i32[B, P]
    positions: jax.Array,  # i32[B, T]
    valid: jax.Array,  # bool[B, T]
) -> tuple[jax.Array, jax.Array]:
    """Scatter this chunk's K/V into its pages. Invalid (padding) tokens are dropped, not written.

    The cache is viewed as rows of head_dim so one scatter handles every head: flattening a donated
    buffer is free, and the scatter updates it in place.
    """
    L, K, NP, S, H = k_cache.shape
    page = jnp.take_along_axis(page_table, positions // S, axis=1, mode="clip")  # i32[B, T]
    slot = page * S + positions % S  # i32[B, T]  within one head's pages
    head = jnp.arange(K, dtype=jnp.int32)[:, None, None]  # i32[K, 1, 1]
    rows = (layer * K + head) * (NP * S) + slot[None]  # i32[K, B, T]
    rows = jnp.where(valid[None], rows, L * K * NP * S)  # out of range -> dropped
    def scatter(cache, new):
        flat = cache.reshape(L * K * NP * S, H)
        flat = flat.at[rows].set(new.transpose(2, 0, 1, 3).astype(cache.dtype), mode="drop")
        return flat.reshape(cache.shape)
    return scatter(k_cache, k_new), scatter(v_cache, v_new)


def copy_pages(cache: KVCache, src: jax.Array, dst: jax.Array, replica: int = 0) -> KVCache:
    """Copy whole pages (all layers and heads) src[i] -> dst[i]: copy-on-write for forked sequences."""
    k = cache.k.at[replica, :, :, dst].set(cache.k[replica, :, :, src])
    v = cache.v.at[replica, :, :, dst].set(cache.v[replica, :, :, src])
    return KVCache(k=k, v=v)


copy_pages_jit = jax.jit(copy_pages, static_argnames=("replica",), donate_argnames=("cache",))
