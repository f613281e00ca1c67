"""An engine replica killed under load (the mock engine, two replicas): its open streams end with an
in-band error, no request hangs, the other replica's streams finish, and Serve replaces the replica."""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest

from jaxserve.serving.ray.deployments import AppSpec
from jaxserve.testing.mock_engine import mock_settings
from serving_testlib import running_replicas, wait_for

STREAMS, TOKENS = 16, 300


@pytest.fixture(scope="module")
def url(deploy):
    spec = AppSpec(settings=mock_settings(), model_name="mock", num_replicas=2, mock_engine=True, mock_token_delay=0.01)
    return deploy(spec, name="faults")


def kill_replica(replica_id: str) -> None:
    import ray

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].endswith(f"#{replica_id}") and "JaxserveEngine" in a["name"]
    ]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


def test_a_killed_replica_fails_its_streams_only_and_is_replaced(url):
    rng = random.Random(0)
    results: list[dict] = [{} for _ in range(STREAMS)]
    started = threading.Semaphore(0)

    def stream(i: int, client: httpx.Client) -> None:
        body = {
            "model": "mock",
            "prompt": [rng.randrange(3, 250) for _ in range(24)],
            "stream": True,
            "max_tokens": TOKENS,
            "ignore_eos": True,
        }
        out = results[i]
        out["chunks"] = []
        try:
            with client.stream("POST", "/v1/completions", json=body) as r:
                out["replica"] = r.headers.get("x-jaxserve-replica")
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        if not out["chunks"]:
                            started.release()
                        out["chunks"].append(line[6:])
        finally:
            if not out["chunks"]:
                started.release()

    with httpx.Client(base_url=url, timeout=60) as client:
        threads = [threading.Thread(target=stream, args=(i, client)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        for _ in range(STREAMS):
            assert started.acquire(timeout=60)
        victim = results[0]["replica"]
        kill_replica(victim)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a request hung after its replica died"

    on_victim = [r for r in results if r["replica"] == victim]
    others = [r for r in results if r["replica"] != victim]
    assert on_victim and others, [r["replica"] for r in results]
    for r in on_victim:
        assert any("error" in json.loads(c) for c in r["chunks"] if c != "[DONE]"), r["chunks"][-2:]
    for r in others:
        assert r["chunks"][-1] == "[DONE]" and len(r["chunks"]) == TOKENS + 1, r["chunks"][-2:]

    assert wait_for(lambda: running_replicas("faults") == 2, 90), "Serve did not replace the killed replica"
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(8):
            r = client.post(
                "/v1/completions", json={"model": "mock", "prompt": [rng.randrange(3, 250)] * 8, "max_tokens": 3}
            )
            assert r.status_code == 200, r.text
