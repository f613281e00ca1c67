"""The trainer's routes (issue 53, part 3) on a server over the real engine: vLLM's /sleep, /wake_up,
/is_sleeping, /pause, /resume, /is_paused behind --enable-sleep-mode, and SGLang's
/update_weights_from_disk and /get_weight_version."""

import os
import shutil
import threading

import numpy as np
import pytest
from server_testlib import sse_events
from starlette.testclient import TestClient

from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.llm_engine import LLMEngine
from jaxserve.loading.checkpoint import iter_safetensors, write_safetensors
from jaxserve.server.api import ServerOptions, create_app

SETTINGS = {
    "dtype": "float32",
    "page_size": 8,
    "max_model_len": 32,
    "max_num_seqs": 2,
    "max_num_batched_tokens": 16,
    "compilation_cache_dir": "none",
}
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_text_model, tmp_path_factory):
    model_dir, tok_dir = tiny_text_model
    other = str(tmp_path_factory.mktemp("sleep-routes") / "b")  # the same model, every weight moved
    shutil.copytree(model_dir, other)
    rng = np.random.default_rng(2)
    tensors = iter_safetensors(os.path.join(model_dir, "model.safetensors"))
    moved = {n: x + rng.normal(0, 0.05, x.shape).astype(x.dtype) for n, x in tensors}
    write_safetensors(os.path.join(other, "model.safetensors"), moved)
    config = EngineConfig(model=model_dir, tokenizer=tok_dir, enable_sleep_mode=True, **SETTINGS)
    engine = AsyncLLMEngine(LLMEngine(config))
    engine.start()
    app = create_app(ServerOptions(served_model_names=("tiny",)), engine, shutdown_engine=True)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, model_dir, other


def complete(client) -> str:
    response = client.post("/v1/completions", json=BODY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_sleep_and_wake_up(server):
    client, _, _ = server
    want = complete(client)
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert client.post("/sleep", params={"level": 1}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    refused = client.post("/v1/completions", json=BODY)
    assert refused.status_code == 503 and "wake_up" in refused.json()["error"]["message"]
    assert client.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}  # the weights are still on the host
    assert client.post("/wake_up").status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert complete(client) == want
    assert client.post("/sleep", params={"level": 3}).status_code == 400
    assert client.post("/wake_up", params={"tags": "optimizer"}).status_code == 400


def test_pause_keep_holds_requests_until_resume(server):
    client, _, _ = server
    want = complete(client)
    assert client.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert client.get("/is_paused").json() == {"is_paused": True}
    done: list[str] = []
    waiting = threading.Thread(target=lambda: done.append(complete(client)))
    waiting.start()
    waiting.join(0.5)
    assert not done  # sent while paused: it waits
    assert client.post("/resume").json() == {"status": "resumed"}
    waiting.join(30)
    assert done == [want]
    assert client.get("/is_paused").json() == {"is_paused": False}
    assert client.post("/pause", params={"mode": "later"}).status_code == 400
    for mode in ("abort", "wait"):
        assert client.post("/pause", params={"mode": mode}).status_code == 200
        assert client.post("/resume").status_code == 200
    assert complete(client) == want


def test_update_weights_from_disk(server):
    client, model_dir, other = server
    want = complete(client)
    response = client.post("/update_weights_from_disk", json={"model_path": other, "weight_version": "v7"})
    assert response.status_code == 200 and response.json()["success"] is True, response.text
    assert client.get("/get_weight_version").json() == {"weight_version": "v7"}
    assert complete(client) != want
    assert client.post("/v1/completions", json=BODY).json()["metadata"] == {"weight_version": "v7"}  # as SGLang
    body = {"model_path": model_dir, "abort_all_requests": True, "load_format": "auto", "flush_cache": True}
    assert client.post("/update_weights_from_disk", json=body).json()["num_paused_requests"] == 0
    assert complete(client) == want
    bad = client.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert bad.status_code == 400 and bad.json()["success"] is False


def test_streamed_chunks_carry_the_weight_version(server):
    """SGLang's metadata on every streamed chunk from the first output on, as on a whole response."""
    client, model_dir, _ = server
    body = {"model_path": model_dir, "weight_version": "v8"}
    assert client.post("/update_weights_from_disk", json=body).json()["success"] is True
    stream = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=stream) as response:
        assert response.status_code == 200
        chunks = [e for e in sse_events(response.iter_lines()) if e != "[DONE]"]
    assert len(chunks) >= 2 and "usage" in chunks[-1]  # the tokens' chunks, then the usage chunk
    assert all(chunk["metadata"] == {"weight_version": "v8"} for chunk in chunks)


def test_the_routes_are_off_without_the_flag(make_client):
    client = make_client()  # the mock engine, started without --enable-sleep-mode
    for method, path in [("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping"), ("post", "/pause")]:
        response = getattr(client, method)(path)
        assert response.status_code == 404 and "--enable-sleep-mode" in response.json()["error"]["message"]


def test_the_mock_engine_answers_them_too(make_client, tmp_path):
    """`jaxserve serve --mock-engine --enable-sleep-mode`: the same routes and refusals, no model."""
    client = make_client(settings={"enable_sleep_mode": True})
    body = {**BODY, "model": "mock"}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/sleep", params={"level": 2}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    assert client.post("/v1/completions", json=body).status_code == 503
    response = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "v2"})
    assert response.json()["success"] is True
    assert client.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert client.get("/get_weight_version").json() == {"weight_version": "v2"}
    assert client.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    assert client.get("/is_paused").json() == {"is_paused": True}
    assert client.post("/resume").status_code == 200
    assert client.post("/v1/completions", json=body).status_code == 200
