"""Prefill and decode on separate engines: the scheduler half of `JaxTransferConnector` (host only).

The flow is vLLM's P/D proxy's. The proxy sends a request to a prefill engine (kv_role kv_producer)
with `max_tokens` 1 and `kv_transfer_params: {"do_remote_decode": true}`. When that request
finishes, `request_finished` keeps its prompt's pages (delay_free) and returns where to pull them
from; the engine puts those params on the final output, the proxy copies them into the same request
sent to a decode engine (kv_role kv_consumer). There, `get_num_new_matched_tokens` claims the
prompt's tokens but the last (the last page partial; that token is recomputed and samples the first
output token, so the output is the one engine's), the pull runs on the worker's threads while the sequence waits in
`Scheduler.loading`, and the pages are written before it runs. The prefill engine frees its pages
when the decode engine says it pulled them, or after `abort_request_timeout` seconds if nobody did
(vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT).

The params, vLLM's NIXL names where they exist:
    to the prefill engine:   {"do_remote_decode": true}
    from it, to the decode:  {"do_remote_prefill": true, "do_remote_decode": false,
                              "remote_engine_id", "remote_host", "remote_port" (the side channel),
                              "remote_transfer_address", "transfer_id", "remote_block_ids",
                              "num_remote_tokens", "prompt_hash"}

The device half (the transfer server and the worker) is `jaxserve.disagg`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
from collections.abc import Callable
from typing import Any

from jaxserve.errors import RequestError
from jaxserve.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler, PageLoad, PageSave

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "JaxTransferConnector"
DEFAULT_ABORT_TIMEOUT_S = 120.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default
DEFAULT_PULL_TIMEOUT_S = 30.0

_REMOTE_KEYS = {
    "remote_host": str,
    "remote_port": int,
    "remote_transfer_address": str,
    "transfer_id": int,
    "remote_block_ids": list,
    "num_remote_tokens": int,
    "prompt_hash": str,
}
_KNOWN_KEYS = set(_REMOTE_KEYS) | {"do_remote_prefill", "do_remote_decode", "remote_engine_id", "tp_size"}


def prompt_hash(token_ids: list[int]) -> str:
    """A short digest of the prompt's ids: the decode engine loads pages only for the same prompt."""
    h = hashlib.blake2b(digest_size=12)
    h.update(",".join(map(str, token_ids)).encode())
    return h.hexdigest()


def check_params(params: Any) -> dict | None:
    """A request's `kv_transfer_params`, checked where the request enters (the server's 400 names the
    problem): a JSON object of the keys above, and with do_remote_prefill every remote key typed."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise RequestError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    unknown = sorted(set(params) - _KNOWN_KEYS)
    if unknown:
        raise RequestError(f"kv_transfer_params: unknown keys {unknown}; known: {sorted(_KNOWN_KEYS)}")
    if params.get("do_remote_prefill") and params.get("do_remote_decode"):
        raise RequestError("kv_transfer_params: do_remote_prefill and do_remote_decode are exclusive")
    if params.get("do_remote_prefill"):
        for key, kind in _REMOTE_KEYS.items():
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise RequestError(
                    f"kv_transfer_params: do_remote_prefill needs {key!r} ({kind.__name__}), got {value!r} "
                    "(pass the prefill response's kv_transfer_params unchanged)"
                )
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in params["remote_block_ids"]):
            raise RequestError("kv_transfer_params: remote_block_ids must be a list of page ids")
    return params


@dataclasses.dataclass
class DisaggMeta(KVConnectorMetadata):
    """The base metadata plus what only this connector's worker reads: loads to drop (their sequence
    was aborted while its pages were pulled: their pages are someone else's now) and remote offers to
    release without pulling (the decode engine had the prompt cached, or refused the params)."""

    cancels: list[str] = dataclasses.field(default_factory=list)
    releases: list[dict] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.cancels or self.releases)


@dataclasses.dataclass
class _Offered:
    transfer_id: int
    page_ids: list[int]


class DisaggScheduler(KVConnectorScheduler):
    """Both roles' scheduler half. `endpoint`: where this engine's worker serves pulls ({"host",
    "port", "transfer_address"}; the producer writes it into its params); `expect(id, ttl)`: the
    transport's registration of a transfer id."""

    def __init__(
        self,
        config: Any,
        page_size: int,
        endpoint: dict | None = None,
        expect: Callable[[int, float], None] | None = None,
    ):
        super().__init__(config, page_size)
        # The transport's registration of a transfer id, called before the params leave: a decode
        # engine's claim that arrives before the pages are read then waits for them.
        self._expect = expect
        extra = config.kv_connector_extra_config
        self.abort_timeout_s = float(extra.get("abort_request_timeout", DEFAULT_ABORT_TIMEOUT_S))
        self.pull_timeout_s = float(extra.get("pull_timeout", DEFAULT_PULL_TIMEOUT_S))
        self.endpoint = endpoint or {}
        self.engine_id = config.engine_id or f"jaxserve-{self.endpoint.get('port', 0)}"
        self._meta = DisaggMeta()
        self._sending: dict[str, _Offered] = {}  # producer: seq id -> its offer, until finished_saving
        self._loading: dict[str, dict] = {}  # consumer: seq id -> its params, until its load ends
        self._counts = dict.fromkeys(
            ("kv_transfer_offers", "kv_transfer_offers_freed", "kv_transfer_loads", "kv_transfer_loads_done",
             "kv_transfer_loads_failed", "kv_transfer_loads_cancelled", "kv_transfer_params_refused",
             # vLLM's names (tokens): what the decode engine asked a prefill engine for, and loaded
             "external_prefix_cache_queries", "external_prefix_cache_hits"),
            0,
        )  # fmt: skip

    # -- decode side (consumer) -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = getattr(seq.params, "kv_transfer_params", None)
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        if seq.output_token_ids or seq.num_preemptions:  # readmitted after a preemption: it recomputes
            return 0, False
        prompt = seq.prompt_token_ids
        if params["num_remote_tokens"] != len(prompt) or params["prompt_hash"] != prompt_hash(prompt):
            logger.warning(
                "request %s: its kv_transfer_params were made for another prompt (%d tokens there, %d here); "
                "recomputing it",
                seq.request_id,
                params["num_remote_tokens"],
                len(prompt),
            )
            self._counts["kv_transfer_params_refused"] += 1
            self._meta.releases.append(params)
            return 0, False
        # Every prompt token but the last (its step samples the first output token here), the last page
        # partial; what the device prefix cache already holds is not pulled again.
        n = len(prompt) - 1 - num_computed_tokens
        if n <= 0:  # the decode engine's own prefix cache holds it all
            self._meta.releases.append(params)
            return 0, False
        self._loading[seq.seq_id] = dict(params, first_page=num_computed_tokens // self.page_size, num_tokens=n)
        self._counts["external_prefix_cache_queries"] += n
        return n, True

    def update_state_after_alloc(self, seq: Any, page_ids: list[int], num_external_tokens: int) -> None:
        source = dict(self._loading[seq.seq_id], pull_timeout=self.pull_timeout_s)
        self._meta.loads.append(PageLoad(seq.seq_id, seq.replica, list(page_ids), source, source["first_page"]))
        self._counts["kv_transfer_loads"] += 1

    # -- prefill side (producer) ------------------------------------------------------------------

    def request_finished(self, seq: Any, page_ids: list[int]) -> tuple[bool, dict | None]:
        if seq.seq_id in self._loading:  # aborted while its pages were being pulled
            del self._loading[seq.seq_id]
            self._meta.cancels.append(seq.seq_id)
            self._counts["kv_transfer_loads_cancelled"] += 1
            return False, None
        params = getattr(seq.params, "kv_transfer_params", None)
        if not self.config.is_producer or not params or not params.get("do_remote_decode"):
            return False, None
        if seq.finish_reason == "abort" or seq.num_computed < len(seq.prompt_token_ids):
            return False, None
        # What a decode engine loads: the pages of every prompt token but the last (that one it computes
        # itself, sampling the first output token), the last page partial.
        pages = list(page_ids[: -(-(len(seq.prompt_token_ids) - 1) // self.page_size)])
        if not pages:
            return False, None
        transfer_id = random.SystemRandom().getrandbits(53)  # below 2**53: exact in every JSON client
        if self._expect is not None:
            self._expect(transfer_id, self.abort_timeout_s)
        self._sending[seq.seq_id] = _Offered(transfer_id, pages)
        self._meta.saves.append(PageSave(seq.seq_id, seq.replica, pages, (transfer_id, self.abort_timeout_s)))
        self._counts["kv_transfer_offers"] += 1
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.endpoint.get("host"),
            "remote_port": self.endpoint.get("port"),
            "remote_transfer_address": self.endpoint.get("transfer_address"),
            "transfer_id": transfer_id,
            "remote_block_ids": pages,
            "num_remote_tokens": len(seq.prompt_token_ids),
            "prompt_hash": prompt_hash(seq.prompt_token_ids),
        }

    # -- both -------------------------------------------------------------------------------------

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, DisaggMeta()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for seq_id in output.finished_saving:
            if self._sending.pop(seq_id, None) is not None:
                self._counts["kv_transfer_offers_freed"] += 1
        for seq_id in output.finished_loading:
            if (loaded := self._loading.pop(seq_id, None)) is not None:
                self._counts["kv_transfer_loads_done"] += 1
                self._counts["external_prefix_cache_hits"] += loaded["num_tokens"]
        for seq_id in output.failed_loading:
            if self._loading.pop(seq_id, None) is not None:
                self._counts["kv_transfer_loads_failed"] += 1

    def has_pending_work(self) -> bool:
        """Pages held for a pull (freed by a pull or the timeout) or sequences waiting on one: the
        engine keeps polling the worker while this is true, even with nothing to run."""
        return bool(self._sending or self._loading or self._meta)

    def stats(self) -> dict:
        return dict(
            self._counts,
            kv_transfer_pages_held=sum(len(o.page_ids) for o in self._sending.values()),
            kv_transfer_requests_held=len(self._sending),
            kv_transfer_requests_loading=len(self._loading),
        )
