"""A prefix-aware request router for the handle from the ingress to the engine deployment.

A request goes to the replica most likely to hold its prompt's prefix in its KV cache: the one the
router sent the longest run of the prompt's leading blocks (`PrefixIndex`, keyed as the replicas key
their pages; the least loaded of them when several hold it). When no replica holds even one block, or the holder's queue is longer than the
shortest by more than `imbalance` requests, it goes to the less loaded of two random replicas, and
from then on that replica holds the prefix. The choice is recorded when it is made, so a burst of
requests sharing a new prefix follows the first instead of scattering before any is routed.

Configured with `request_router_config=RequestRouterConfig(request_router_class=PrefixAwareRouter,
request_router_kwargs={"block_size": 16, "imbalance": 8})` (deployments.py does it). The class is
built on first use (`router.PrefixAwareRouter`), so this module imports without the `[ray]` extra.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from jaxserve.serving.prefix_index import PrefixIndex


def prompt_ids(pending: Any) -> Sequence[int] | None:
    """The prompt's token ids of an `EngineReplica.generate(request)` call (an EngineRequest)."""
    if pending is None:
        return None
    request = pending.args[0] if pending.args else pending.kwargs.get("request")
    ids = getattr(request, "prompt_token_ids", None)
    return ids if isinstance(ids, (list, tuple)) else None


def _build() -> type:
    from ray.serve.request_router import FIFOMixin, RequestRouter

    class PrefixAwareRouter(FIFOMixin, RequestRouter):
        def initialize_state(
            self, block_size: int = 16, imbalance: int = 8, max_blocks: int = 200_000, **_: Any
        ) -> None:
            self.index = PrefixIndex(block_size=block_size, max_blocks=max_blocks)
            self.imbalance = imbalance
            self.routed = {"prefix": 0, "balanced": 0}  # how each choice was made (tests and logs read it)

        async def _queue_lens(self, replicas: list[Any]) -> dict[Any, int]:
            """Known queue lengths: the handle's cache where fresh, else a probe; replicas that do not
            answer are left out."""
            lens, unknown = {}, []
            for r in replicas:
                cached = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
                if cached is None:
                    unknown.append(r)
                else:
                    lens[r.replica_id] = cached
            if unknown:
                for r, queue_len in await self._probe_queue_lens(unknown, 0):
                    if queue_len is not None:
                        lens[r.replica_id] = queue_len
            return lens

        async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
            if not candidate_replicas:
                return []
            by_id = {r.replica_id: r for r in candidate_replicas}
            ids = prompt_ids(pending_request)
            holders, _ = self.index.match(ids, list(by_id)) if ids else ([], 0)
            chosen = None
            if holders:
                lens = await self._queue_lens(candidate_replicas)
                known = [h for h in holders if h in lens]
                if known:
                    holder = min(known, key=lambda h: lens[h])  # the least loaded of those holding the most
                    if lens[holder] - min(lens.values()) <= self.imbalance:
                        chosen = by_id[holder]
                        self.routed["prefix"] += 1
            if chosen is None:
                pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
                lens = await self._queue_lens(pair)
                chosen = min(pair, key=lambda r: lens.get(r.replica_id, float("inf")))
                self.routed["balanced"] += 1
            if ids:
                self.index.insert(ids, chosen.replica_id)
            rest = [r for r in candidate_replicas if r is not chosen]
            return [[chosen], rest] if rest else [[chosen]]

        def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
            ids = prompt_ids(pending_request)
            if ids:  # a full chosen replica sends the request elsewhere: the prefix is there now
                self.index.insert(ids, replica_id)

        def update_replicas(self, replicas: list[Any]) -> None:
            gone = set(self._replicas) - {r.replica_id for r in replicas}
            super().update_replicas(replicas)
            for replica_id in gone:
                self.index.remove(replica_id)

        def on_replica_actor_died(self, replica_id: Any) -> None:
            super().on_replica_actor_died(replica_id)
            self.index.remove(replica_id)

    PrefixAwareRouter.__module__, PrefixAwareRouter.__qualname__ = __name__, "PrefixAwareRouter"
    return PrefixAwareRouter


_built: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """`PrefixAwareRouter`, built (importing ray) the first time it is asked for; pickled by reference."""
    if name != "PrefixAwareRouter":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _built:
        _built[name] = _build()
    return _built[name]
