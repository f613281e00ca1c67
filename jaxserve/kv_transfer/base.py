"""The KV connector interface (host only, no jax): how KV pages enter and leave an engine's device pool.

Modelled on vLLM V1's KVConnector, split the same way into a scheduler half and a worker half, both
driven by the engine's one step thread (`EngineCore`; nothing here is thread-safe unless a
connector says so). One step, as the engine calls them:

    schedule():  Scheduler._admit -> blocks.admit (device prefix hits first), then
                 get_num_new_matched_tokens(seq, num_computed)  -> (tokens the connector has, async?)
                 update_state_after_alloc(seq, page_ids, num_external_tokens)   (only if > 0)
                 on_page_evicted(replica, page, key) for every cached page the allocator reuses
    execute():   meta = build_connector_meta()          (once per step, after admission and top-ups)
                 worker.start_save_kv(meta)             (reads of pages leaving the pool, first)
                 worker.start_load_kv(meta)             (writes into the pages just allocated)
                 fork copies, then the step itself      (the device runs them in this order)
    update:      update_connector_output(worker.get_finished())  -> the scheduler moves waiting
                 sequences on (finished_loading) and frees delayed pages (finished_saving)
    finish:      request_finished(seq, page_ids) -> (delay_free, kv_transfer_params)

A sequence whose load is asynchronous (`get_num_new_matched_tokens` says so) holds its pages but is
neither running nor waiting: the scheduler keeps it in `Scheduler.loading` (`Status.WAITING_FOR_KV`)
until a `KVConnectorOutput` names it in `finished_loading` (it then runs with those tokens computed)
or in `failed_loading` (it then recomputes them). A synchronous load is written before the step that
first runs the sequence, so it runs at once. A finished sequence whose `request_finished` asked for a
delayed free keeps its pages (held, so no one reuses them) until `finished_saving` names it.

Pages are the block manager's (`engine.block_manager`): page ids local to a replica, `page_size`
tokens each, full computed pages keyed by `blake2b(parent key + tokens)` from the sequence's root
(`Sequence.prefix_root`: each LoRA adapter's own). A connector never allocates or frees pages itself;
it names which pages to read or write, and the engine's `PageIO` (`runner/page_io.py`) moves them in
fixed-size chunks (one compiled read and one compiled write per replica, whatever the request).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

# vLLM's roles: a producer only saves (a prefill engine), a consumer only loads (a decode engine).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclasses.dataclass
class PageLoad:
    """Fill device pages `page_ids` of `replica` (token order: the sequence's pages
    [first_page, first_page + len(page_ids))) from the connector's `source` before the step runs."""

    seq_id: str
    replica: int
    page_ids: list[int]
    source: Any  # the connector's own handle (the host tier: the pages' chain keys)
    first_page: int = 0


@dataclasses.dataclass
class PageSave:
    """Read device pages `page_ids` of `replica` to host memory and send them to `dest`. `seq_id`
    None: pages leaving the device prefix cache (evicted), no sequence waits on them."""

    seq_id: str | None
    replica: int
    page_ids: list[int]
    dest: Any  # the connector's own handle (the host tier: the pages' chain keys)


@dataclasses.dataclass
class KVConnectorMetadata:
    """What the worker half does before this step runs: saves first (their pages may be reused by
    this very step), then loads."""

    saves: list[PageSave] = dataclasses.field(default_factory=list)
    loads: list[PageLoad] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


@dataclasses.dataclass
class KVConnectorOutput:
    """What finished since the last call (sequence ids): asynchronous loads done (the sequence may
    run), loads that failed (it recomputes those tokens), saves done (its delayed pages may be freed)."""

    finished_loading: set[str] = dataclasses.field(default_factory=set)
    failed_loading: set[str] = dataclasses.field(default_factory=set)
    finished_saving: set[str] = dataclasses.field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.finished_loading or self.failed_loading or self.finished_saving)


class PendingPages(Protocol):
    """Pages being read to the host (`PageIO.read_pages`): the copy is started, `result()` waits."""

    def result(self) -> dict[str, Any]:
        """Leaf name ("k", "v", and "k_scale", "v_scale" for an int8 cache) -> numpy array whose
        leading axis is the pages read, in the order asked (k: [n, layers, kv_heads, page_size, head_dim])."""
        ...


class PageIO(Protocol):
    """The device half's page mover (`jaxserve.runner.page_io.PageIO`), handed to the worker."""

    page_bytes: int  # host bytes of one page, every layer and leaf (scales included)

    def read_pages(self, replica: int, page_ids: list[int]) -> PendingPages: ...

    def write_pages(self, replica: int, page_ids: list[int], pages: dict[str, Any]) -> None: ...


class KVConnectorScheduler:
    """The scheduler's half. Defaults do nothing, so a connector overrides what it uses."""

    def __init__(self, config: KVTransferConfig, page_size: int):
        self.config = config
        self.page_size = page_size

    def get_num_new_matched_tokens(self, seq: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after `num_computed_tokens` (the device's prefix hit, a multiple of page_size) that
        the connector can load into `seq`'s pages: a multiple of page_size, leaving at least the
        sequence's last token to compute. The bool: the load is asynchronous (the sequence waits in
        `Scheduler.loading` until `finished_loading` names it) rather than written before its first step."""
        return 0, False

    def update_state_after_alloc(self, seq: Any, page_ids: list[int], num_external_tokens: int) -> None:
        """`seq` was admitted and will take `num_external_tokens` from the connector: `page_ids` are its
        pages for them (device pages of `seq.replica`, in token order, starting at the device hit).
        The connector queues their load for `build_connector_meta`."""

    def build_connector_meta(self) -> KVConnectorMetadata:
        """The saves and loads queued since the last step, for the worker half; resets the queue."""
        return KVConnectorMetadata()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker's report for the step (the scheduler acts on it after the connector has seen it)."""

    def request_finished(self, seq: Any, page_ids: list[int]) -> tuple[bool, dict | None]:
        """`seq` finished (or was aborted) holding `page_ids`. Returns (delay_free, kv_transfer_params):
        with delay_free the pages stay held until `finished_saving` names the sequence (a producer
        sending them on); the params go back to the caller on the request's final output."""
        return False, None

    def on_page_evicted(self, replica: int, page: int, key: bytes) -> None:
        """The device prefix cache is about to reuse cached `page` (its chain key `key`): the page's
        content is intact until the step after this schedule, so a save queued now reads it."""

    def on_prefix_cache_reset(self) -> None:
        """The weights changed (or the user reset the cache): every stored page is stale."""

    def stats(self) -> dict:
        """Counters for `EngineCore.stats()` and /metrics."""
        return {}


class KVConnectorWorker:
    """The device half: moves pages through a `PageIO`. No jax here: the PageIO owns the arrays."""

    def __init__(self, config: KVTransferConfig):
        self.config = config
        self.page_io: PageIO | None = None

    def register_page_io(self, page_io: PageIO) -> None:
        """Called once, after the KV cache is allocated (vLLM's register_kv_caches)."""
        self.page_io = page_io

    def start_save_kv(self, meta: KVConnectorMetadata) -> None:
        """Start reading `meta.saves` (before the step that may overwrite them is dispatched)."""

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Write `meta.loads` whose data is at hand (host tier: all); asynchronous ones later."""

    def get_finished(self) -> KVConnectorOutput:
        """What finished since the last call (polled once per step, never blocking)."""
        return KVConnectorOutput()

    def stats(self) -> dict:
        """Counters for `EngineCore.stats()` and /metrics (bytes moved, say)."""
        return {}

    def close(self) -> None:
        """Release what the worker holds (host buffers, transfer servers)."""


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's `--kv-transfer-config` JSON: {"kv_connector": NAME, "kv_role": ROLE, ...}. Unknown keys
    are refused (a misspelled key must not be ignored); connector names are checked against the
    registry (`kv_transfer.factory`) when the engine builds one."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = dataclasses.field(default_factory=dict)
    engine_id: str | None = None
    kv_buffer_size: float | None = None  # bytes (vLLM's), where a connector sizes a buffer by it
    # vLLM's transport fields, for connectors that move pages between engines (pd's)
    kv_ip: str | None = None
    kv_port: int | None = None
    kv_rank: int | None = None
    kv_parallel_size: int | None = None
    kv_buffer_device: str | None = None
    kv_load_failure_policy: str = "recompute"  # vLLM's: recompute | fail

    @classmethod
    def from_dict(cls, value: Any) -> KVTransferConfig:
        from jaxserve.errors import ConfigError

        if isinstance(value, KVTransferConfig):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"kv_transfer_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"kv_transfer_config: unknown keys {unknown}; known: {sorted(known)}")
        if not isinstance(value.get("kv_connector"), str) or not value["kv_connector"]:
            raise ConfigError('kv_transfer_config needs "kv_connector": the connector\'s name')
        role = value.get("kv_role", "kv_both")
        if role not in KV_ROLES:
            raise ConfigError(f"kv_transfer_config: kv_role {role!r} is not one of {KV_ROLES}")
        extra = value.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ConfigError("kv_transfer_config: kv_connector_extra_config must be a JSON object")
        if value.get("kv_load_failure_policy", "recompute") not in ("recompute", "fail"):
            raise ConfigError("kv_transfer_config: kv_load_failure_policy must be recompute or fail")
        return cls(**{**value, "kv_role": role, "kv_connector_extra_config": dict(extra)})

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
