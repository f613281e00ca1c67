"""The prefix cache's host-memory tier (`--kv-offloading-size GiB --kv-offloading-backend native`).

A full computed page the device pool evicts (`BlockManager`'s least recently freed cached page, about
to be reused) is read to host memory before the step that overwrites it, under its chain key; the
host keeps the most recently used pages within its byte budget (LRU). When a prompt is admitted, the
device's prefix hit is taken first, and the host tier extends it page by page along the same chain of
keys (so a LoRA adapter's root keeps its pages apart here too): those pages are written into the
sequence's freshly allocated device pages before its first step, which then starts after them. A
loaded page is registered in the device prefix cache again and stays on the host (the tier is
inclusive: when the device evicts it again, no read is needed).

Both halves live in the engine's process and share one `HostStore`; every load is synchronous to the
step (written before the step that first runs the sequence, in the device's order), so no sequence
waits in `Scheduler.loading` for this connector. vLLM's OffloadingConnector (`--kv-offloading-size`)
stores computed blocks to CPU memory the same way; this one stores them when they leave the device.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from jaxserve.engine.block_manager import chain_keys
from jaxserve.errors import ConfigError
from jaxserve.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferConfig,
    PageLoad,
    PageSave,
)

GIB = 2**30


class HostStore:
    """Pages in host memory by chain key, least recently used evicted first, at most `capacity_pages`.

    A saved page enters as (its pending read, its index there): the read's host copy was only started.
    `settle()` (the next step, by when the read has long run on the device) copies each page out on its
    own, so an entry holds its page's bytes and no padding of the read's chunk."""

    def __init__(self, capacity_pages: int):
        self.capacity_pages = capacity_pages
        self.entries: collections.OrderedDict[bytes, Any] = collections.OrderedDict()  # key -> page or pending
        self._pending: list[tuple[Any, list[bytes]]] = []
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def touch(self, key: bytes) -> None:
        self.entries.move_to_end(key)

    def put_read(self, read: Any, keys: list[bytes]) -> int:
        """Enter the pages of a started read under `keys` (those already here are only touched);
        returns how many entered."""
        added = 0
        for i, key in enumerate(keys):
            if key in self.entries:
                self.entries.move_to_end(key)
                continue
            self.entries[key] = _Pending(read, i)
            added += 1
        while len(self.entries) > self.capacity_pages:
            self.entries.popitem(last=False)
            self.num_evicted += 1
        if added:
            self._pending.append((read, keys))
        return added

    def settle(self) -> None:
        """Copy the pages of every started read out of its chunks (waiting for any not done yet)."""
        for read, keys in self._pending:
            host = None
            for i, key in enumerate(keys):
                entry = self.entries.get(key)
                if isinstance(entry, _Pending) and entry.read is read:
                    host = read.result() if host is None else host
                    self.entries[key] = {name: np.array(x[i]) for name, x in host.items()}
        self._pending = []

    def pages(self, keys: list[bytes]) -> dict[str, np.ndarray]:
        """The pages of `keys`, stacked per leaf in key order (each touched: most recently used)."""
        if any(isinstance(self.entries[key], _Pending) for key in keys):
            self.settle()
        rows = []
        for key in keys:
            rows.append(self.entries[key])
            self.entries.move_to_end(key)
        return {name: np.stack([r[name] for r in rows]) for name in rows[0]}

    def clear(self) -> None:
        self.entries.clear()
        self._pending = []


class _Pending:
    __slots__ = ("read", "index")

    def __init__(self, read: Any, index: int):
        self.read, self.index = read, index


class HostTierScheduler(KVConnectorScheduler):
    """Finds host hits after the device's and queues the pages' loads; queues evicted pages' saves."""

    def __init__(self, config: KVTransferConfig, page_size: int, store: HostStore, page_bytes: int):
        super().__init__(config, page_size)
        self.store = store
        self.page_bytes = page_bytes
        self._matched: dict[str, list[bytes]] = {}  # seq id -> the host keys it will load
        self._loads: list[PageLoad] = []
        self._saves: dict[int, PageSave] = {}  # replica -> its evicted pages this step
        self.queried_tokens = 0  # prompt tokens past the device hit looked up here
        self.hit_tokens = 0

    def get_num_new_matched_tokens(self, seq: Any, num_computed_tokens: int) -> tuple[int, bool]:
        ps = self.page_size
        tokens = seq.token_view
        # As the device's lookup: the last token is always computed (its logits give the first sample).
        max_pages = max(0, len(tokens) - 1) // ps
        first = num_computed_tokens // ps
        self.queried_tokens += max(0, max_pages - first) * ps
        if first >= max_pages or not self.store:
            return 0, False
        keys = []
        for i, key in enumerate(chain_keys(tokens, ps, seq.prefix_root, max_pages)):
            if i < first:
                continue
            if key not in self.store:
                break
            keys.append(key)
        if not keys:
            return 0, False
        self._matched[seq.seq_id] = keys
        return len(keys) * ps, False

    def update_state_after_alloc(self, seq: Any, page_ids: list[int], num_external_tokens: int) -> None:
        keys = self._matched.pop(seq.seq_id)
        if num_external_tokens != len(keys) * self.page_size or len(page_ids) != len(keys):
            raise ValueError(f"{seq.seq_id}: {len(page_ids)} pages for {len(keys)} host pages")
        for key in keys:  # most recently used now: a save this step must not evict them
            self.store.touch(key)
        self.hit_tokens += num_external_tokens
        first = seq.num_computed // self.page_size
        self._loads.append(PageLoad(seq.seq_id, seq.replica, list(page_ids), keys, first))

    def on_page_evicted(self, replica: int, page: int, key: bytes) -> None:
        if key in self.store:  # already on the host (loaded from here, or saved before)
            self.store.touch(key)
            return
        save = self._saves.setdefault(replica, PageSave(None, replica, [], []))
        save.page_ids.append(page)
        save.dest.append(key)

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(saves=list(self._saves.values()), loads=self._loads)
        self._saves, self._loads = {}, []
        return meta

    def on_prefix_cache_reset(self) -> None:
        self.store.clear()
        self._saves.clear()  # pages computed with the old weights

    def request_finished(self, seq: Any, page_ids: list[int]) -> tuple[bool, dict | None]:
        self._matched.pop(seq.seq_id, None)
        return False, None

    def stats(self) -> dict:
        return dict(
            external_prefix_cache_queries=self.queried_tokens,
            external_prefix_cache_hits=self.hit_tokens,
            kv_offload_host_pages=len(self.store),
            kv_offload_host_capacity_pages=self.store.capacity_pages,
            kv_offload_host_evicted_pages_total=self.store.num_evicted,
        )


class HostTierWorker(KVConnectorWorker):
    """Reads evicted pages to the store and writes host hits into device pages, through the PageIO."""

    def __init__(self, config: KVTransferConfig, store: HostStore):
        super().__init__(config)
        self.store = store
        self._reads: list[tuple[Any, list[bytes]]] = []
        self.pages_to_host = 0
        self.pages_to_device = 0

    def start_save_kv(self, meta: KVConnectorMetadata) -> None:
        self.store.settle()  # the reads of earlier steps, done on the device by now
        for save in meta.saves:
            if save.page_ids:
                self._reads.append((self.page_io.read_pages(save.replica, save.page_ids), save.dest))

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        # Loads take their pages from the store before this step's saves enter it (which may evict).
        for load in meta.loads:
            self.page_io.write_pages(load.replica, load.page_ids, self.store.pages(load.source))
            self.pages_to_device += len(load.page_ids)
        for read, keys in self._reads:
            self.store.put_read(read, keys)
            self.pages_to_host += len(keys)
        self._reads = []

    def stats(self) -> dict:
        b = self.page_io.page_bytes if self.page_io is not None else 0
        return dict(
            kv_offload_pages_to_host_total=self.pages_to_host,
            kv_offload_pages_to_device_total=self.pages_to_device,
            kv_offload_bytes_to_host_total=self.pages_to_host * b,
            kv_offload_bytes_to_device_total=self.pages_to_device * b,
        )

    def close(self) -> None:
        self.store.clear()
        self._reads = []


def make_connector(
    config: KVTransferConfig, *, page_size: int, page_bytes: int, capacity_bytes: int | None = None, **_: Any
) -> tuple[HostTierScheduler, HostTierWorker]:
    """Both halves over one store of `capacity_bytes` (`kv_connector_extra_config["cpu_bytes_to_use"]`
    when the config came as JSON, vLLM's key)."""
    if capacity_bytes is None:
        capacity_bytes = config.kv_connector_extra_config.get("cpu_bytes_to_use")
    if not isinstance(capacity_bytes, (int, float)) or capacity_bytes <= 0:
        raise ConfigError(
            "the host tier needs a size: --kv-offloading-size GiB, or kv_connector_extra_config "
            '{"cpu_bytes_to_use": BYTES}'
        )
    capacity_pages = int(capacity_bytes // page_bytes)
    if capacity_pages < 1:
        raise ConfigError(
            f"kv_offloading_size of {capacity_bytes / GIB:.3g} GiB holds no page of {page_bytes} bytes; give it more"
        )
    store = HostStore(capacity_pages)
    return HostTierScheduler(config, page_size, store, page_bytes), HostTierWorker(config, store)
