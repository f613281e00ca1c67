"""Prefill and decode in two real server processes (`python -m jaxserve.serve` with the
JaxTransferConnector as kv_producer and kv_consumer) behind the P/D proxy
(`jaxserve.serving.disagg_proxy`): answers equal the decode server's own (greedy, float32), streamed
or not; the client's bad input is the prefill server's 400; a prefill server that dies after
answering leaves the decode to recompute; a decode server that is gone, or a prefill server that is
gone, is a 503 naming it, at once; pages nobody pulls are freed after the timeout (read from
/metrics)."""

import json
import sys
import time
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_testlib import ServerProcess, parse_metrics

from jaxserve.serving.disagg_proxy import DisaggProxy, create_app

ENGINE = [
    "--config", "small", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
    "--max-num-batched-tokens", "64", "--num-pages", "96", "--max-num-seqs", "8",
]  # fmt: skip
DEAD = "http://127.0.0.1:1"  # nothing listens there: a server that has died


def prompt(start: int) -> list[int]:
    """45 token ids: the pages of the first 44 (3, the last partial) move. Each test its own, so no
    server has it cached."""
    return list(range(start, start + 45))


def kv(role: str, **extra) -> list[str]:
    config = {"kv_connector": "JaxTransferConnector", "kv_role": role, "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    p = ServerProcess(ENGINE + kv("kv_producer", abort_request_timeout=2.0), logs / "p.log", startup_timeout=300)
    d = ServerProcess(ENGINE + kv("kv_consumer", pull_timeout=5.0), logs / "d.log", startup_timeout=300)
    try:
        p.start(), d.start()
        yield p, d
    finally:
        p.stop(), d.stop()


def proxy(prefill: list[str], decode: list[str]) -> TestClient:
    return TestClient(create_app(DisaggProxy(prefill, decode, retries=1, timeout=120)), raise_server_exceptions=False)


def pages_used(server: ServerProcess, timeout: float = 10.0) -> float:
    """The server's KV pages in use, once they reach 0 (or what they are at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        used = parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)["jaxserve:kv_pages_used"]
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def body(start: int, **extra) -> dict:
    return {"prompt": prompt(start), "max_tokens": 12, "temperature": 0, **extra}


def metric(server: ServerProcess, name: str) -> float:
    return parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)[name]


def test_answers_through_the_proxy_equal_the_decode_servers_own(servers):
    p, d = servers
    # The reference from the prefill server as one engine (a plain request: it keeps nothing for a pull).
    want = [
        httpx.post(p.url + "/v1/completions", json=body(s), timeout=120).json()["choices"][0]["text"]
        for s in (300, 400)
    ]
    received = metric(d, 'jaxserve:kv_transfer_pages_total{direction="received"}')
    with proxy([p.url], [d.url]) as client:
        r = client.post("/v1/completions", json=body(300))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[0]
        assert r.headers["x-jaxserve-prefill"] == p.url and r.headers["x-jaxserve-decode"] == d.url
        with client.stream("POST", "/v1/completions", json=body(400, stream=True)) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want[1]
    chat = {"messages": [{"role": "user", "content": "def add(a, b):\n    return a + b\n" * 3}], "max_tokens": 8}
    chat_want = httpx.post(p.url + "/v1/chat/completions", json={**chat, "temperature": 0}, timeout=120).json()
    with proxy([p.url], [d.url]) as client:
        r = client.post("/v1/chat/completions", json={**chat, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == chat_want["choices"][0]["message"]
    # Every prompt token's page but the last token came over the transport, and both sides hold none.
    assert metric(d, 'jaxserve:kv_transfer_pages_total{direction="received"}') >= received + 7
    assert metric(d, "jaxserve:kv_transfer_loads_failed_total") == 0
    assert pages_used(p) == 0 and pages_used(d) == 0


def test_the_clients_bad_input_is_the_prefill_servers_400(servers):
    p, d = servers
    with proxy([p.url], [d.url]) as client:
        r = client.post("/v1/completions", json=body(500, top_p=5))
        assert r.status_code == 400 and "top_p" in r.text
        r = client.post("/v1/completions", json=body(500, kv_transfer_params={"do_remote_prefill": True}))
        assert r.status_code == 400 and "kv_transfer_params" in r.text


def test_a_decode_server_that_is_gone_is_retried_then_a_503_and_the_prefills_pages_are_freed(servers):
    p, d = servers
    want = httpx.post(p.url + "/v1/completions", json=body(600, max_tokens=5), timeout=120).json()["choices"][0]["text"]
    with proxy([p.url], [DEAD, d.url]) as client:  # the dead one first in turn, then d
        texts = [
            client.post("/v1/completions", json=body(600, max_tokens=5)).json()["choices"][0]["text"] for _ in range(2)
        ]
    assert texts == [want, want]
    with proxy([p.url], [DEAD]) as client:
        t0 = time.monotonic()
        r = client.post("/v1/completions", json=body(700, max_tokens=5))
        assert r.status_code == 503 and "decode" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 30
    assert metric(p, "jaxserve:kv_transfer_pages_held") == 3  # kept for a pull that never comes
    assert pages_used(p, timeout=10) == 0  # then freed after abort_request_timeout (2 s)
    assert metric(p, "jaxserve:kv_transfer_offers_expired_total") >= 1


def test_a_prefill_server_that_dies_after_answering_leaves_the_decode_to_recompute(servers):
    p, d = servers
    want = httpx.post(p.url + "/v1/completions", json=body(800), timeout=120).json()["choices"][0]["text"]
    pre = httpx.post(
        p.url + "/v1/completions",
        json=body(800, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        timeout=120,
    ).json()
    params = pre["kv_transfer_params"]
    assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == 3
    p.stop(sig=9)  # SIGKILL: its pages, and its transfer server, are gone
    t0 = time.monotonic()
    failed = metric(d, "jaxserve:kv_transfer_loads_failed_total")
    r = httpx.post(d.url + "/v1/completions", json=body(800, kv_transfer_params=params), timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert time.monotonic() - t0 < 30
    assert metric(d, "jaxserve:kv_transfer_loads_failed_total") == failed + 1  # recomputed, not hung
    assert pages_used(d) == 0
    with proxy([p.url], [d.url]) as client:
        r = client.post("/v1/completions", json=body(900))
        assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]
