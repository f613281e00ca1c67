"""The engine's side of a KV connector: where the scheduler and the core call its two halves.

`KVConnectorDriver` holds the scheduler half, the worker half and the sequences a connector holds
apart from the scheduler's queues: `loading` (admitted, pages allocated, waiting for an asynchronous
load: `Status.WAITING_FOR_KV`) and `saving` (finished, pages kept until their save is done). The
scheduler calls `admitted` and `finished`; the core calls `poll` before it schedules and `start`
before it dispatches a step (`kv_transfer.base` says when each connector method runs). Host only.
"""

from __future__ import annotations

import json
from typing import Any

from jaxserve.engine.sequence import Status
from jaxserve.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler, KVConnectorWorker


class KVConnectorDriver:
    def __init__(self, connector: KVConnectorScheduler, worker: KVConnectorWorker, scheduler: Any):
        self.connector, self.worker, self.scheduler = connector, worker, scheduler
        self.blocks = scheduler.blocks
        self.loading: dict[str, Any] = {}  # seq id -> Sequence waiting for its KV
        self.saving: dict[str, Any] = {}  # seq id -> finished Sequence whose pages are being saved
        self.blocks.listen(connector.on_page_evicted, connector.on_prefix_cache_reset)
        self.num_loads_failed = 0

    # ---- the scheduler's calls -----------------------------------------------------------------
    def admitted(self, seq: Any) -> bool:
        """`seq` was just admitted (its device prefix hit in `seq.num_computed`): the connector may give
        it more. A synchronous load counts those tokens computed now (they are written before the step
        that first runs it); an asynchronous one parks it in `loading`. Returns True if it waits."""
        n, is_async = self.connector.get_num_new_matched_tokens(seq, seq.num_computed)
        if n <= 0:
            return False
        ps = self.blocks.page_size
        # Whole pages, or every token but the last (a prefill engine's pages: the last one partial, in a
        # page this sequence alone holds; only full pages are ever shared).
        to_last = seq.num_computed + n == seq.num_tokens - 1
        if (n % ps and not to_last) or seq.num_computed + n > seq.num_tokens - 1:
            raise ValueError(
                f"{type(self.connector).__name__} offered {n} tokens to {seq.seq_id} ({seq.num_computed} "
                f"computed of {seq.num_tokens}): need whole pages (or all but the last token), and the last "
                "token left to compute"
            )
        first = seq.num_computed // ps
        pages = self.blocks.page_table(seq.seq_id)[first : first + -(-n // ps)]
        self.connector.update_state_after_alloc(seq, pages, n)
        if is_async:
            seq.status = Status.WAITING_FOR_KV
            seq.kv_load_tokens = n
            self.loading[seq.seq_id] = seq
            return True
        self._computed(seq, n)
        return False

    def finished(self, seq: Any) -> bool:
        """`seq` finished holding pages: True if the connector keeps them until its save is done."""
        delay, params = self.connector.request_finished(seq, self.blocks.page_table(seq.seq_id))
        seq.kv_transfer_params_out = params
        if delay:
            self.saving[seq.seq_id] = seq
        return delay

    def dropped(self, seq: Any) -> None:
        """`seq` was aborted while its KV was loading: its pages go back (a late write into them is
        harmless: nobody reads a page before a later step computes or loads it again)."""
        if self.loading.pop(seq.seq_id, None) is not None:
            self.connector.request_finished(seq, self.blocks.page_table(seq.seq_id))
            self.blocks.free(seq.seq_id)

    # ---- the core's calls ----------------------------------------------------------------------
    def poll(self) -> KVConnectorOutput:
        """Before a step is scheduled: what finished moves on (loaded sequences run, saved ones free)."""
        out = self.worker.get_finished()
        if not out:
            return out
        self.connector.update_connector_output(out)
        for seq_id in sorted(out.finished_loading | out.failed_loading):
            seq = self.loading.pop(seq_id, None)
            if seq is None:
                continue
            if seq_id in out.failed_loading:
                self.num_loads_failed += 1  # recomputed from its device hit instead
            else:
                self._computed(seq, seq.kv_load_tokens)
            seq.kv_load_tokens = 0
            seq.status = Status.RUNNING
            self.scheduler.running.append(seq)
        for seq_id in sorted(out.finished_saving):
            if self.saving.pop(seq_id, None) is not None:
                self.blocks.free(seq_id)
        return out

    def start(self) -> None:
        """Before a step is dispatched (and before fork copies): the saves read first, then the loads
        write, in the device's order."""
        meta = self.connector.build_connector_meta()
        if meta:
            self.worker.start_save_kv(meta)
            self.worker.start_load_kv(meta)

    def stats(self) -> dict:
        return dict(
            num_waiting_for_kv=len(self.loading),
            num_saving_kv=len(self.saving),
            kv_loads_failed_total=self.num_loads_failed,
            **self.connector.stats(),
            **self.worker.stats(),
        )

    def close(self) -> None:
        self.worker.close()

    def _computed(self, seq: Any, n: int) -> None:
        seq.num_computed += n
        self.blocks.mark_computed(seq.seq_id, seq.token_view, seq.num_computed)


def connector_config(engine_config: Any) -> Any:
    """The engine's KVTransferConfig: `kv_transfer_config` as given, or the host tier's when
    `kv_offloading_size` is set (vLLM builds its OffloadingConnector from that flag the same way);
    None without either."""
    from jaxserve.kv_transfer.base import KVTransferConfig
    from jaxserve.kv_transfer.factory import OFFLOADING_CONNECTOR

    if engine_config.kv_transfer_config is not None:
        value = engine_config.kv_transfer_config  # the settings keep it as canonical JSON text
        return KVTransferConfig.from_dict(json.loads(value) if isinstance(value, str) else value)
    if engine_config.kv_offloading_size is not None:
        return KVTransferConfig(OFFLOADING_CONNECTOR, "kv_both")
    return None


def build_driver(engine_config: Any, scheduler: Any, runner: Any) -> KVConnectorDriver | None:
    """The engine's connector, both halves, over the runner's page mover; None when none is configured."""
    from jaxserve.kv_transfer.factory import create_connector

    config = connector_config(engine_config)
    if config is None:
        return None
    page_io = runner.enable_page_io()
    size = engine_config.kv_offloading_size
    connector, worker = create_connector(
        config,
        page_size=scheduler.blocks.page_size,
        page_bytes=page_io.page_bytes,
        num_replicas=scheduler.blocks.num_replicas,
        capacity_bytes=None if size is None else int(size * 2**30),
        engine_config=engine_config,
    )
    worker.register_page_io(page_io)
    return KVConnectorDriver(connector, worker, scheduler)


def validate_kv_transfer(engine_config: Any) -> None:
    """`EngineConfig.validate`'s checks of the connector settings: ConfigError naming the problem."""
    from jaxserve.errors import ConfigError
    from jaxserve.kv_transfer.factory import check_connector

    c = engine_config
    if c.kv_offloading_size is not None and not c.kv_offloading_size > 0:
        raise ConfigError(f"kv_offloading_size must be positive GiB, got {c.kv_offloading_size}")
    if c.kv_offloading_size is not None and c.kv_transfer_config is not None:
        raise ConfigError(
            "kv_offloading_size builds the host tier's connector and kv_transfer_config names one: "
            "an engine has one connector, so set one of them"
        )
    config = connector_config(c)
    if config is None:
        return
    check_connector(config)
    for refused, why in (
        (c.speculation in ("draft", "eagle3"), f"speculative_method={c.speculation!r} (its draft's cache)"),
        (c.num_processes > 1, "a multi-host job (num_processes > 1)"),
        (not c.enable_prefix_caching, "enable_prefix_caching=false (pages are found by their prefix keys)"),
    ):
        if refused:
            raise ConfigError(f"a KV connector ({config.kv_connector}) is not supported with {why}")
