"""One `/metrics` over the engine deployment: every live engine replica's engine series under
`replica="<id>"` (the id of the `x-jaxserve-replica` header), then the ingress's own HTTP and latency
series once, as Prometheus text.

`ReplicaMetrics` (ASGI middleware around the ingress's server) answers `GET /metrics` itself: it
broadcasts `EngineReplica.stats` to every replica the handle's router knows and renders each answer
with the single-engine server's collector (jaxserve/server/metrics.py). A replica that does not
answer within `timeout_s` is left out of that scrape (and logged); the scrape still succeeds.
The engine's own data-parallel series (`*_replica{replica="0"}`) keep that index as `shard`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric

from jaxserve.server.metrics import _EngineCollector

logger = logging.getLogger(__name__)

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def replica_families(replica_stats: list[dict]) -> list[Metric]:
    """The engine series of every replica's `stats()`, one family per name, each sample labelled
    `replica=<stats["replica"]>`."""
    merged: dict[str, Metric] = {}
    for stats in sorted(replica_stats, key=lambda s: str(s.get("replica"))):
        replica = str(stats.get("replica"))
        for family in _EngineCollector(lambda s=stats: s, lambda: None).collect():
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            for sample in family.samples:
                labels = dict(sample.labels)
                if "replica" in labels:  # the engine's own data-parallel index
                    labels["shard"] = labels.pop("replica")
                into.samples.append(sample._replace(labels={**labels, "replica": replica}))
    return list(merged.values())


class _Families:
    """A registry-like object for `generate_latest`: the replicas' families, then the ingress's own
    (less those the replicas' cover: the ingress's RemoteEngine view would repeat their names)."""

    def __init__(self, replicas: list[Metric], ingress: Any):
        self._replicas = replicas
        self._ingress = ingress

    def collect(self):
        names = {family.name for family in self._replicas}
        yield from self._replicas
        if self._ingress is not None:
            yield from (family for family in self._ingress.collect() if family.name not in names)


def render(replica_stats: list[dict], ingress_registry: Any) -> bytes:
    return generate_latest(_Families(replica_families(replica_stats), ingress_registry))


class ReplicaMetrics:
    """ASGI middleware: `GET /metrics` is every engine replica's series plus the ingress's own.
    `handle`: the engine deployment's DeploymentHandle (or a list: prefill and decode);
    `ingress_registry()`: the server's registry (or None before the server has one)."""

    def __init__(self, app: Any, handle: Any, ingress_registry: Callable[[], Any], timeout_s: float = 5.0):
        self.app = app
        handles = handle if isinstance(handle, (list, tuple)) else [handle]  # several: prefill and decode
        self.handles = [h.options(stream=False) for h in handles]
        self.ingress_registry = ingress_registry
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/metrics" or scope["method"] != "GET":
            return await self.app(scope, receive, send)
        body = await asyncio.to_thread(render, await self.replica_stats(), self.ingress_registry())
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def replica_stats(self) -> list[dict]:
        """`stats()` of every replica that answered in time."""
        results = []
        for handle in self.handles:
            try:
                results += await handle.broadcast("stats").results_async(
                    timeout_s=self.timeout_s, return_exceptions=True
                )
            except Exception as err:  # noqa: BLE001 - Ray's errors: a scrape without that deployment's series
                logger.warning("metrics: broadcasting stats to the engine replicas failed: %s", err)
        answered = [r for r in results if isinstance(r, dict)]
        for r in results:
            if not isinstance(r, dict):
                logger.warning("metrics: an engine replica did not answer stats: %s", r)
        return answered
