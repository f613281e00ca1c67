"""The prefix-aware router on two replicas of the mock engine (the routing, not the model, is under
test): each group of requests sharing a 512-token prefix stays on one replica; requests without a
known prefix spread over both."""

from __future__ import annotations

import collections
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jaxserve.serving.ray.deployments import AppSpec
from jaxserve.testing.mock_engine import mock_settings

GROUPS, PER_GROUP, PREFIX = 4, 16, 512


@pytest.fixture(scope="module")
def url(deploy):
    spec = AppSpec(
        settings=mock_settings(max_model_len=1024, num_pages=2048),
        model_name="mock",
        num_replicas=2,
        mock_engine=True,
        mock_token_delay=0.002,
    )
    return deploy(spec)


def complete(client: httpx.Client, ids: list[int]) -> str:
    r = client.post("/v1/completions", json={"model": "mock", "prompt": ids, "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r.headers["x-jaxserve-replica"]


def test_each_shared_prefix_group_stays_on_one_replica(url):
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 250) for _ in range(PREFIX)] for _ in range(GROUPS)]
    requests = [
        (g, prefixes[g] + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 40))])
        for g in range(GROUPS)
        for _ in range(PER_GROUP)
    ]
    with httpx.Client(base_url=url, timeout=60) as client:
        # A group's first request, alone, places its prefix (as a system prompt first seen); the rest
        # arrive together, interleaved across groups.
        firsts = {g: complete(client, ids) for g, ids in requests[::PER_GROUP]}
        rest = [r for i, r in enumerate(requests) if i % PER_GROUP]
        rng.shuffle(rest)
        with ThreadPoolExecutor(8) as pool:
            served = list(pool.map(lambda item: (item[0], complete(client, item[1])), rest))
    by_group = collections.defaultdict(collections.Counter)
    for g, replica in [*firsts.items(), *served]:
        by_group[g][replica] += 1
    for g, counts in by_group.items():
        top = counts.most_common(1)[0][1]
        assert top >= 0.9 * PER_GROUP, (g, counts)


def test_requests_without_a_shared_prefix_spread_over_both_replicas(url):
    rng = random.Random(1)
    requests = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(32)]
    with httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(8) as pool:
        served = collections.Counter(pool.map(lambda ids: complete(client, ids), requests))
    assert len(served) == 2 and min(served.values()) >= 4, served
