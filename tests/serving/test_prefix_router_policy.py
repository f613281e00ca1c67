"""PrefixAwareRouter's choice alone: Ray's router machinery is replaced by fakes (queue lengths as
given), so the policy runs without a cluster."""

from __future__ import annotations

import asyncio
import types

import pytest

from jaxserve.engine.processor import EngineRequest
from jaxserve.sampling.params import SamplingParams
from jaxserve.serving.ray import router as router_module

PREFIX = list(range(100, 164))  # 4 blocks of 16


def make_router(queues: dict[str, int], imbalance: int = 8):
    cls = router_module.PrefixAwareRouter
    router = object.__new__(cls)  # skip RequestRouter.__init__ (it wants a running Serve controller)
    router._use_replica_queue_len_cache = False

    async def probe(replicas, backoff_index):
        return [(r, queues[r.replica_id]) for r in replicas]

    router._probe_queue_lens = probe
    router.initialize_state(block_size=16, imbalance=imbalance)
    replicas = [types.SimpleNamespace(replica_id=name) for name in queues]
    return router, replicas


def request(ids):
    """A pending `EngineReplica.generate(request)` call."""
    return types.SimpleNamespace(args=[EngineRequest("req", ids, SamplingParams())], kwargs={})


def choose(router, replicas, ids):
    ranks = asyncio.run(router.choose_replicas(replicas, request(ids)))
    return ranks[0][0].replica_id, [r.replica_id for rank in ranks for r in rank]


def test_the_holder_of_the_prefix_gets_it_while_queues_are_close():
    queues = {"a": 0, "b": 0, "c": 0}
    router, replicas = make_router(queues)
    first, order = choose(router, replicas, PREFIX + [1])
    assert sorted(order) == ["a", "b", "c"]  # the others follow as the fallback rank
    queues[first] = 5  # busier, within the imbalance: the prefix still decides
    for tail in ([2, 3], [4], list(range(30))):
        assert choose(router, replicas, PREFIX + tail)[0] == first
    assert router.routed["prefix"] == 3


def test_a_clearly_longer_queue_sends_the_prefix_elsewhere_and_there_it_stays():
    queues = {"a": 0, "b": 0}
    router, replicas = make_router(queues, imbalance=8)
    first, _ = choose(router, replicas, PREFIX)
    other = "b" if first == "a" else "a"
    queues[first] = 9  # 9 > 0 + 8
    assert choose(router, replicas, PREFIX + [7])[0] == other
    queues[first], queues[other] = 3, 1  # both hold the prefix now: the less loaded of them gets it
    assert choose(router, replicas, PREFIX)[0] == other
    queues[first], queues[other] = 1, 3
    assert choose(router, replicas, PREFIX)[0] == first


def test_prompts_without_a_known_prefix_go_to_the_less_loaded_of_two():
    router, replicas = make_router({"a": 7, "b": 1})
    picks = {choose(router, replicas, [i] * 20)[0] for i in range(20)}
    assert picks == {"b"}
    assert router.routed["balanced"] == 20


@pytest.mark.parametrize("pending", [None, types.SimpleNamespace(args=[], kwargs={})])
def test_calls_without_prompt_ids_are_balanced(pending):
    router, replicas = make_router({"a": 3, "b": 0})
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    assert ranks[0][0].replica_id == "b" and len(router.index) == 0
