"""Whole KV pages between one replica's device cache and host memory, for the KV connectors.

`PageIO.read_pages` gathers pages (every layer, every KV head, and an int8 cache's per-slot scales)
to numpy; `write_pages` puts host pages into device pages. Both go in chunks of a fixed number of
pages, padded with the padding page (`kv_cache.padded_page_chunks`, as forked pages are copied), so
each replica has one compiled read and one compiled write, whatever the requests (warmed up at
start-up, counted in `ModelRunner.num_executables`). A float8 cache's pages move as bytes, and its
per-layer scales stay (they are not per page). On a mesh the gather's result is fetched whole to the
host (each shard's KV heads), and a write's host pages are placed by the compiler on the cache's
shardings, which the written cache keeps.

Both are dispatched in the device's order: a read queued before a step sees the pages as the steps
before it left them, and a write queued before a step is what that step reads.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.kv_cache import KVCache, as_bytes, from_bytes, is_fp8, padded_page_chunks

# Pages per compiled read or write: a prefix of a few thousand tokens moves in a handful of calls.
DEFAULT_PAGE_CHUNK = 16


def _leaves(cache: KVCache) -> dict[str, jax.Array]:
    """The per-page leaves of the cache by name (a float8 cache's scales are per layer: not moved)."""
    out = {"k": cache.k, "v": cache.v}
    if cache.quantized and not cache.fp8:
        out.update(k_scale=cache.k_scale, v_scale=cache.v_scale)
    return out


@functools.partial(jax.jit, static_argnames=("replica",))
def _gather(leaves: dict, pages: jax.Array, replica: int) -> dict:
    """leaf [R, L, K, NP, S, ...] -> [W, L, K, S, ...] of `pages` i32[W] (float8 as bytes)."""
    return {name: jnp.moveaxis(as_bytes(x)[replica][:, :, pages], 2, 0) for name, x in leaves.items()}


def _scatter(cache: KVCache, pages: jax.Array, data: dict, replica: int) -> KVCache:
    """`data` leaf [W, L, K, S, ...] written into `pages` i32[W] of `replica` (donated cache)."""

    def put(x, new):
        b = as_bytes(x)  # the int replica and the page ids index apart: the pages' axis comes first
        return from_bytes(b.at[replica, :, :, pages].set(new.astype(b.dtype)), x.dtype)

    return cache.replace(**{name: put(getattr(cache, name), new) for name, new in data.items()})


class PendingRead:
    """A read dispatched, its host copy started; `result()` waits for it (numpy, the pages asked for)."""

    def __init__(self, chunks: list[dict], num_pages: int):
        self._chunks, self._n, self._host = chunks, num_pages, None

    def result(self) -> dict[str, np.ndarray]:
        if self._host is None:
            names = self._chunks[0].keys()
            self._host = {
                name: np.concatenate([np.asarray(c[name]) for c in self._chunks])[: self._n] for name in names
            }
            self._chunks = []
        return self._host


class PageIO:
    """Reads and writes whole pages of the target model's cache in `DeviceState` (runner.state)."""

    def __init__(self, state: Any, width: int = DEFAULT_PAGE_CHUNK):
        self.state = state
        self.width = width
        self.warmed: set[int] = set()  # replicas whose read and write are compiled
        leaves = _leaves(state.cache)
        self.leaf_names = tuple(leaves)
        # Host bytes of one page: each leaf's [L, K, S, ...] slice (float8 as bytes).
        self.page_bytes = sum(
            math.prod(x.shape[1:3]) * math.prod(x.shape[4:]) * np.dtype(as_bytes_dtype(x.dtype)).itemsize
            for x in leaves.values()
        )
        shardings = jax.tree.map(lambda x: x.sharding, state.cache)
        self._write = jax.jit(
            _scatter, static_argnames=("replica",), donate_argnames=("cache",), out_shardings=shardings
        )
        self.pages_read = 0
        self.pages_written = 0

    def read_pages(self, replica: int, page_ids: list[int]) -> PendingRead:
        ids = np.asarray(page_ids, np.int32)
        chunks = []
        for src, _ in padded_page_chunks(ids, ids, self.width):
            out = _gather(_leaves(self.state.cache), src, replica=replica)
            for x in out.values():
                x.copy_to_host_async()
            chunks.append(out)
        self.pages_read += len(ids)
        return PendingRead(chunks, len(ids))

    def write_pages(self, replica: int, page_ids: list[int], pages: dict[str, np.ndarray]) -> None:
        ids = np.asarray(page_ids, np.int32)
        n = len(ids)
        for start, (dst, _) in zip(range(0, max(n, 1), self.width), padded_page_chunks(ids, ids, self.width)):
            data = {}
            for name in self.leaf_names:
                block = np.asarray(pages[name][start : start + self.width])
                if len(block) < self.width:  # padding rows go to the padding page
                    pad = np.zeros((self.width - len(block), *block.shape[1:]), block.dtype)
                    block = np.concatenate([block, pad])
                data[name] = block
            self.state.cache = self._write(self.state.cache, dst, data, replica=replica)
        self.pages_written += n

    def warm_up(self, num_replicas: int) -> None:
        """Compile the read and the write of every replica (a read and a write of page 0, the padding page)."""
        for replica in range(num_replicas):
            if replica in self.warmed:
                continue
            pages = self.read_pages(replica, []).result()
            self.write_pages(replica, [], pages)
            self.warmed.add(replica)
        self.pages_read = self.pages_written = 0

    @property
    def num_executables(self) -> int:
        return 2 * len(self.warmed)


def as_bytes_dtype(dtype: Any) -> Any:
    """The host dtype of a leaf: float8 moves as uint8."""
    return np.uint8 if is_fp8(dtype) else dtype
