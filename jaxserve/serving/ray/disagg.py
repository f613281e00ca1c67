"""Prefill and decode on separate replicas: `jaxserve serve-ray --prefill-replicas N --decode-replicas M`.

Two engine deployments, `JaxservePrefill` (kv_role kv_producer) and `JaxserveDecode` (kv_consumer),
both `EngineReplica`s with the `JaxTransferConnector` (docs/disaggregation.md), and one ingress,
jaxserve's OpenAI server over a `DisaggRemoteEngine`. For each request the ingress:

1. sends it to a prefill replica with `max_tokens` 1 and `kv_transfer_params: {"do_remote_decode":
   true}` and waits for its final output, whose `kv_transfer_params` say where its pages wait;
2. sends the request itself, those params added, to a decode replica, and streams that replica's
   deltas to the server (the client sees only the decode's output: its first token is sampled
   there from the pulled pages, so it equals one engine's).

Both handles route with `PrefixAwareRouter` (the prompt's leading blocks, `prefix_index.py`): a
prompt goes back to the prefill replica holding its prefix, and to the decode replica holding it.

Faults: a refusal of the request (the client's bad input) is the server's 400, from the prefill. A
prefill replica that fails (dies, Ray loses it, its engine errs) before its output is final: the
request goes to another prefill replica (`retries`), then fails with ReplicaUnavailable (503). A
decode replica that dies before accepting: another one takes it (RemoteEngine's rule); once it has
streamed, the request fails alone (an in-band error event). A decode that cannot pull the pages
(the prefill replica died after answering, or the pull timed out) recomputes the prompt itself: the
output is the same, and the prefill replica frees unpulled pages after `abort_request_timeout`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any

from jaxserve.engine.processor import EngineRequest
from jaxserve.serving.ray.remote_engine import RemoteEngine, ReplicaUnavailable

logger = logging.getLogger(__name__)

CONNECTOR = "JaxTransferConnector"
PREFILL, DECODE = "kv_producer", "kv_consumer"


def role_settings(settings: Any, role: str, extra: dict | None = None) -> Any:
    """An engine's settings for one side: the JaxTransferConnector in `role`, with `extra` (the
    connector's kv_connector_extra_config) over what the settings already give it."""
    current = json.loads(settings.kv_transfer_config) if settings.kv_transfer_config else {}
    if current and current.get("kv_connector", CONNECTOR) != CONNECTOR:
        raise ValueError(f"--prefill-replicas needs the {CONNECTOR} connector, not {current['kv_connector']!r}")
    merged = {**current.get("kv_connector_extra_config", {}), **(extra or {})}
    config = {**current, "kv_connector": CONNECTOR, "kv_role": role, "kv_connector_extra_config": merged}
    return settings.replace(kv_transfer_config=json.dumps(config, sort_keys=True))


def on_this_node(settings: Any) -> Any:
    """A replica's settings with its connector's "host" set to this node's address (where the other
    side reaches its transfer server), unless the settings name one."""
    if not settings.kv_transfer_config:
        return settings
    config = json.loads(settings.kv_transfer_config)
    if config.get("kv_connector") != CONNECTOR or "host" in config.get("kv_connector_extra_config", {}):
        return settings
    import ray

    return role_settings(settings, config["kv_role"], {"host": ray.util.get_node_ip_address()})


def prefill_request(request: EngineRequest) -> EngineRequest:
    """The request as the prefill replica runs it: one token, one sample, its pages kept for a pull."""
    params = dataclasses.replace(
        request.params, max_tokens=1, min_tokens=0, n=1, kv_transfer_params={"do_remote_decode": True}
    )
    return dataclasses.replace(request, request_id=f"{request.request_id}-prefill", params=params)


class DisaggRemoteEngine(RemoteEngine):
    """RemoteEngine over the decode deployment, each request first prefilled on the prefill
    deployment (`prefill_handle`, streaming)."""

    def __init__(self, prefill_handle: Any, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._prefill_handle = prefill_handle
        self.num_prefill_retries = 0
        self.num_without_pages = 0  # prefills that left no pages to pull (a one-token prompt, a refusal)

    async def submit(self, request: EngineRequest, queue: asyncio.Queue, tag: Any = None) -> None:
        params = await self._prefill(request)
        if params is None:
            self.num_without_pages += 1
        else:
            request = dataclasses.replace(
                request, params=dataclasses.replace(request.params, kv_transfer_params=params)
            )
        await super().submit(request, queue, tag)

    async def _prefill(self, request: EngineRequest) -> dict | None:
        """The prefill's kv_transfer_params (None if it kept no pages). Raises the replica's refusal
        (the server's 400) or ReplicaUnavailable once every try failed."""
        prefill = prefill_request(request)
        failure: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                self.num_prefill_retries += 1
            stream = self._prefill_handle.generate.remote(prefill)
            try:
                first = await stream.__anext__()
                if isinstance(first, BaseException):
                    raise first  # refused: the client's input, not a fault to retry
                params = None
                async for item in stream:
                    if isinstance(item, BaseException):
                        raise ReplicaUnavailable(f"the prefill replica failed: {item}")
                    params = getattr(item, "kv_transfer_params", None) or params
                    if item.finished:
                        return params
                raise ReplicaUnavailable("the prefill replica ended the request without finishing it")
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except ReplicaUnavailable as err:
                failure = err
            except Exception as err:  # Ray's errors (a dead replica); refusals are re-raised
                if _is_refusal(err):
                    raise
                failure = err
            logger.warning(
                "request %s: prefill failed (attempt %d of %d): %s",
                request.request_id,
                attempt + 1,
                self.retries + 1,
                failure,
            )
        raise ReplicaUnavailable(f"no prefill replica finished the request: {type(failure).__name__}: {failure}")

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(),
            "num_prefill_retries": self.num_prefill_retries,
            "num_without_pages": self.num_without_pages,
        }


def _is_refusal(err: BaseException) -> bool:
    from jaxserve.errors import JaxServeError

    return isinstance(err, JaxServeError) and not isinstance(err, ReplicaUnavailable)
