"""`JaxTransferConnector`: prefill and decode on separate engines, pages moved by
`jax.experimental.transfer` (`jaxserve.disagg.transport`).

`make_connector` builds the worker half here (it owns the engine's `TransferEndpoint`) and the
scheduler half (`jaxserve.kv_transfer.disagg.DisaggScheduler`, host only), which writes the
endpoint's address into the prefill's `kv_transfer_params`. Configured as vLLM's connectors are:

    --kv-transfer-config '{"kv_connector": "JaxTransferConnector", "kv_role": "kv_producer"}'   # prefill
    --kv-transfer-config '{"kv_connector": "JaxTransferConnector", "kv_role": "kv_consumer"}'   # decode

`kv_connector_extra_config`: "host" (the address peers reach this engine on, default 127.0.0.1),
"abort_request_timeout" (s, the prefill keeps unpulled pages this long; default 120),
"pull_timeout" (s, the decode gives up a pull after this long and recomputes the prompt; default 30).

The worker runs on the engine's step thread: saves read pages then offer them (the read's host copy
lands by the next poll), loads pull on the transport's threads and are written, when done, by the
poll that sees them (`get_finished`: before that step is dispatched, so it reads them).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from jaxserve.disagg.transport import TransferEndpoint, TransferError
from jaxserve.kv_transfer.base import KVConnectorOutput, KVConnectorWorker, KVTransferConfig
from jaxserve.kv_transfer.disagg import DisaggMeta, DisaggScheduler

logger = logging.getLogger(__name__)


class DisaggWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, endpoint: TransferEndpoint):
        super().__init__(config)
        self.endpoint = endpoint
        self._reading: dict[int, Any] = {}  # transfer id -> its PendingRead, until offered
        self._sending: dict[int, str] = {}  # transfer id -> seq id, until the offer ends
        # Offers that ended (a decode engine's abort, expiry) before their save reached this worker: the
        # registration happens when the request finishes, the save one step later, after that step's poll.
        self._ended_early: set[int] = set()
        self._freed: set[str] = set()  # seq ids whose pages may be freed at the next poll
        self._loading: dict[str, tuple[Any, Any]] = {}  # seq id -> (future of the pages, PageLoad)
        self.pages_sent = 0
        self.pages_received = 0
        self.offers_expired = 0

    # -- prefill side -----------------------------------------------------------------------------

    def start_save_kv(self, meta: DisaggMeta) -> None:
        for save in meta.saves:
            transfer_id, _ = save.dest  # registered with the endpoint when the request finished
            if transfer_id in self._ended_early:  # nobody will pull it: free the pages, read nothing
                self._ended_early.discard(transfer_id)
                self._freed.add(save.seq_id)
                continue
            self._sending[transfer_id] = save.seq_id
            self._reading[transfer_id] = self.page_io.read_pages(save.replica, save.page_ids)

    def _offer_read_pages(self) -> None:
        for transfer_id, pending in list(self._reading.items()):
            pages = pending.result()  # dispatched a step ago: its host copy is there
            self.endpoint.offer(transfer_id, pages)
            self.pages_sent += len(next(iter(pages.values())))
            del self._reading[transfer_id]

    # -- decode side ------------------------------------------------------------------------------

    def start_load_kv(self, meta: DisaggMeta) -> None:
        for params in getattr(meta, "releases", ()):
            self.endpoint.release(_remote(params), params["transfer_id"])
        for load in meta.loads:
            p = load.source
            future = self.endpoint.pull(_remote(p), p["transfer_id"], p["pull_timeout"], check=self._layout_check(load))
            self._loading[load.seq_id] = (future, load)
        for seq_id in getattr(meta, "cancels", ()):  # after the loads: a cancel may follow its load in one meta
            self._loading.pop(seq_id, None)  # its pages are free again: never write the pull into them

    def _layout_check(self, load: Any):
        need = load.first_page + len(load.page_ids)

        def check(leaves: list) -> None:
            names = sorted(name for name, _, _ in leaves)
            if names != sorted(self.page_io.leaf_names):
                raise TransferError(
                    f"the prefill engine's pages hold {names}, this engine's {sorted(self.page_io.leaf_names)}"
                )
            nbytes = sum(math.prod(shape[1:]) * _itemsize(dtype) for _, shape, dtype in leaves)
            if nbytes != self.page_io.page_bytes:
                raise TransferError(
                    f"the prefill engine's pages are {nbytes} bytes, this engine's {self.page_io.page_bytes} "
                    "(another model, page size or kv_cache_dtype)"
                )
            if leaves[0][1][0] < need:
                raise TransferError(f"the prefill engine offers {leaves[0][1][0]} pages, {need} are needed")

        return check

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput(finished_saving=self._freed)
        self._freed = set()
        self._offer_read_pages()
        for transfer_id, how in self.endpoint.take_ended().items():
            seq_id = self._sending.pop(transfer_id, None)
            self._reading.pop(transfer_id, None)  # ended before its pages were read: never offered
            if seq_id is None:
                self._ended_early.add(transfer_id)
                continue
            if how == "expired":
                self.offers_expired += 1
                logger.warning("request %s: nobody pulled its pages in time; freed", seq_id)
            out.finished_saving.add(seq_id)
        for seq_id, (future, load) in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[seq_id]
            error = future.exception()
            if error is not None:
                logger.error("request %s: its prompt's pages could not be pulled (%s); recomputing it", seq_id, error)
                out.failed_loading.add(seq_id)
                continue
            pages = {
                name: a[load.first_page : load.first_page + len(load.page_ids)] for name, a in future.result().items()
            }
            self.page_io.write_pages(load.replica, load.page_ids, pages)
            self.pages_received += len(load.page_ids)
            out.finished_loading.add(seq_id)
        return out

    def stats(self) -> dict:
        return {
            "kv_transfer_pages_sent": self.pages_sent,
            "kv_transfer_pages_received": self.pages_received,
            "kv_transfer_offers_expired": self.offers_expired,
            "kv_transfer_offers_waiting": self.endpoint.num_held(),
        }

    def close(self) -> None:
        self.endpoint.close()


def _remote(params: dict) -> dict:
    return {
        "host": params["remote_host"],
        "port": params["remote_port"],
        "transfer_address": params["remote_transfer_address"],
    }


def _itemsize(dtype: str) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def make_connector(config: KVTransferConfig, *, page_size: int, **options: Any):
    extra = config.kv_connector_extra_config
    endpoint = TransferEndpoint(host=str(extra.get("host", "127.0.0.1")))
    worker = DisaggWorker(config, endpoint)
    address = {"host": endpoint.host, "port": endpoint.side_port, "transfer_address": endpoint.transfer_address}
    return DisaggScheduler(config, page_size, address, expect=endpoint.expect), worker
