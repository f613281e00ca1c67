"""Autoscaling between 1 and 2 replicas of the mock engine (short delays): sustained load brings up
the second replica, the quiet after it takes it down again, and no request is lost on the way."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jaxserve.serving.ray.deployments import AppSpec
from jaxserve.testing.mock_engine import mock_settings
from serving_testlib import running_replicas, wait_for

AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 2,
    "upscale_delay_s": 0.5,
    "downscale_delay_s": 2,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 1,
}


@pytest.fixture(scope="module")
def url(deploy):
    spec = AppSpec(
        settings=mock_settings(),
        model_name="mock",
        num_replicas=None,
        autoscaling=AUTOSCALING,
        mock_engine=True,
        mock_token_delay=0.01,
    )
    return deploy(spec, name="autoscaled")


def test_load_adds_a_replica_and_the_quiet_removes_it(url):
    assert running_replicas("autoscaled") == 1
    served, codes, stop = set(), [], threading.Event()

    def client_loop(client: httpx.Client):
        while not stop.is_set():
            r = client.post(
                "/v1/completions", json={"model": "mock", "prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True}
            )
            codes.append(r.status_code)
            if r.status_code == 200:
                served.add(r.headers["x-jaxserve-replica"])

    with httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(12) as pool:
        loops = [pool.submit(client_loop, client) for _ in range(12)]
        try:
            assert wait_for(lambda: len(served) == 2, 90), f"no second replica served within 90 s: {served}"
        finally:
            stop.set()
            for loop in loops:
                loop.result()
    assert codes and set(codes) == {200}, codes
    assert wait_for(lambda: running_replicas("autoscaled") == 1, 90), "the second replica stayed after the load"
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/completions", json={"model": "mock", "prompt": [1, 2, 3], "max_tokens": 3})
        assert r.status_code == 200
