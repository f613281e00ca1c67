"""`serve-ray --prefill-replicas 1 --decode-replicas 1` on a local Ray cluster: every request is
prefilled on the prefill replica and decoded on the decode replica from the pulled pages; greedy
texts equal one engine's, streamed or not; the client's bad input is a 400; afterwards neither
replica holds a page, and one /metrics shows both replicas' transfer counters."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from jaxserve.config import EngineConfig
from jaxserve.loading.model_source import resolve_model_settings
from jaxserve.serving.ray.deployments import AppSpec

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


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 8000) for _ in range(rng.randrange(20, 70))] for _ in range(n)]


@pytest.fixture(scope="module")
def url(deploy):
    spec = AppSpec(
        settings=resolve_model_settings(EngineConfig.from_dict(SETTINGS)),
        model_name="small",
        prefill_replicas=1,
        decode_replicas=1,
        warm_up=False,
    )
    return deploy(spec)


@pytest.fixture(scope="module")
def reference():
    from jaxserve import LLM, SamplingParams

    settings = {k: v for k, v in SETTINGS.items() if k != "model"}
    with LLM(SETTINGS["model"], warm_up=False, **settings) as llm:
        outs = llm.generate(
            prompt_token_ids=prompts(6), sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        )
    return [o.outputs[0].text for o in outs]


def stats(deployment: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name="jaxserve").stats.remote().result()


def test_prefilled_on_one_replica_decoded_on_the_other_like_one_engine(url, reference):
    ids = prompts(6)
    body = {"model": "small", "max_tokens": MAX_TOKENS, "temperature": 0}
    with httpx.Client(base_url=url, timeout=180) as client:
        texts = [
            client.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"] for p in ids[:4]
        ]
        for p in ids[4:]:
            with client.stream("POST", "/v1/completions", json={**body, "prompt": p, "stream": True}) as s:
                chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
            texts.append("".join(httpx.Response(200, content=c[6:]).json()["choices"][0]["text"] for c in chunks))
        assert texts == reference
        bad = client.post("/v1/completions", json={**body, "prompt": ids[0], "top_p": 5})
        assert bad.status_code == 400 and "top_p" in bad.text
        text = client.get("/metrics").text
    decode, prefill = stats("JaxserveDecode"), stats("JaxservePrefill")
    want_pages = sum(-(-(len(p) - 1) // 16) for p in ids)  # every prompt token's but the last
    assert decode["kv_transfer_pages_received"] == want_pages and decode["kv_transfer_loads_failed"] == 0
    assert prefill["kv_transfer_pages_sent"] == want_pages
    deadline = time.monotonic() + 10
    while stats("JaxservePrefill")["pages_used"] != [0] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats("JaxservePrefill")["pages_used"] == [0] and decode["pages_used"] == [0]
    assert text.count('jaxserve:kv_transfer_pages_total{direction="received"') == 2  # both replicas' series
