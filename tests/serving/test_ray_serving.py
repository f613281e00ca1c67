"""Two fixed replicas of the small model on a local Ray cluster: 200 requests at concurrency 32 all complete,
both replicas serve them (by the x-jaxserve-replica header), and greedy outputs equal one engine's."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jaxserve.config import EngineConfig
from jaxserve.loading.model_source import resolve_model_settings
from jaxserve.serving.ray.deployments import AppSpec

# Few buckets and no warm-up: each replica compiles only the token counts it meets.
SETTINGS = dict(
    model="checkpoints/small",
    dtype="float32",
    page_size=16,
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    token_buckets="powers-of-two",
)
MAX_TOKENS = 8
REQUESTS, CONCURRENCY = 200, 32


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 8000) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def url(deploy):
    spec = AppSpec(
        settings=resolve_model_settings(EngineConfig.from_dict(SETTINGS)),
        model_name="small",
        num_replicas=2,
        warm_up=False,
    )
    return deploy(spec)


@pytest.fixture(scope="module")
def reference():
    """Greedy texts of one in-process engine with the same settings, by prompt."""
    from jaxserve import LLM, SamplingParams

    settings = {k: v for k, v in SETTINGS.items() if k != "model"}
    with LLM(SETTINGS["model"], warm_up=False, **settings) as llm:
        outs = llm.generate(
            prompt_token_ids=prompts(REQUESTS), sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        )
    return [o.outputs[0].text for o in outs]


def complete(client: httpx.Client, ids: list[int], **extra) -> httpx.Response:
    return client.post(
        "/v1/completions", json={"model": "small", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    )


def test_two_replicas_serve_concurrent_requests_like_one_engine(url, reference):
    with httpx.Client(base_url=url, timeout=120) as client, ThreadPoolExecutor(CONCURRENCY) as pool:
        responses = list(pool.map(lambda ids: complete(client, ids), prompts(REQUESTS)))
    assert [r.status_code for r in responses] == [200] * REQUESTS
    served = {r.headers["x-jaxserve-replica"] for r in responses}
    assert len(served) == 2, served
    texts = [r.json()["choices"][0]["text"] for r in responses]
    assert texts == reference


def test_streaming_carries_the_replica_and_the_same_text(url, reference):
    ids = prompts(REQUESTS)[0]
    with httpx.Client(base_url=url, timeout=120) as client:
        with client.stream(
            "POST",
            "/v1/completions",
            json={"model": "small", "prompt": ids, "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0},
        ) as r:
            assert r.status_code == 200
            assert r.headers["x-jaxserve-replica"]
            chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1]) == reference[0]


def test_a_request_the_engine_refuses_is_a_400_with_its_reason(url):
    with httpx.Client(base_url=url, timeout=60) as client:
        r = complete(client, [5] * 300)  # past max_model_len 256: the ingress's own check
        assert r.status_code == 400 and "context length" in r.text, r.text
        r = complete(client, [5, 4], n=9)  # the engine replica's check: more samples than max_num_seqs
        assert r.status_code == 400 and "max_num_seqs" in r.text, r.text
        assert client.get("/health").status_code == 200
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["small"]


def scrape(client: httpx.Client) -> dict[str, dict[str, float]]:
    """{metric sample name: {replica label: value}} of the engine series in one GET /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    r = client.get("/metrics")
    assert r.status_code == 200
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if "replica" in sample.labels:
                out.setdefault(sample.name, {})[sample.labels["replica"]] = sample.value
    return out


def test_one_scrape_of_metrics_holds_every_replica(url):
    with httpx.Client(base_url=url, timeout=120) as client, ThreadPoolExecutor(8) as pool:
        before = scrape(client)
        responses = list(pool.map(lambda ids: complete(client, ids), prompts(32, seed=1)))
        after = scrape(client)
        text = client.get("/metrics").text
    assert [r.status_code for r in responses] == [200] * 32
    served = {r.headers["x-jaxserve-replica"] for r in responses}
    replicas = set(after["jaxserve:num_requests_running"])
    assert len(replicas) == 2 and served <= replicas, (served, replicas)
    generated = sum(r.json()["usage"]["completion_tokens"] for r in responses)
    tokens = after["jaxserve:generation_tokens_total"]
    assert sum(tokens.values()) - sum(before["jaxserve:generation_tokens_total"].values()) == generated
    # the ingress's own HTTP series, once, and each engine family named once
    assert "jaxserve:http_requests_total{" in text
    assert text.count("# TYPE jaxserve:num_requests_running gauge") == 1
