"""Serving while the rest compile (issue 52, part 3): with compile_in_background the server is healthy
once the opening token buckets are compiled; a request needing a bucket still held back runs as steps
of ready ones and answers exactly what a fully compiled engine answers; each bucket is built once and
nothing compiles once all are ready; closing the engine stops the background thread.

The background compile is held by a gate the test opens (`gate`), so nothing here depends on timing."""

from __future__ import annotations

import collections
import threading
import time

import pytest
from starlette.testclient import TestClient

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.llm_engine import LLMEngine
from jaxserve.runner.background_compile import BackgroundCompile
from jaxserve.runner.compilation import CompileCounter
from jaxserve.server.api import ServerOptions, create_app

# Token buckets 1, 4, 8, 16: the engine opens with 1 and 4 (two rows' decodes), 16 and 8 are held.
SETTINGS = dict(
    dtype="float32",
    page_size=8,
    max_model_len=64,
    max_num_seqs=2,
    max_num_batched_tokens=16,
    num_pages=32,
    compilation_cache_dir="none",
    enable_prefix_caching=False,  # the second round computes every prompt token again
)
# 11 and 30 tokens: a 16-token bucket's prompt, and one chunked even then.
PROMPTS = [list(range(3, 14)), [5, 6, 7], list(range(40, 70))]


@pytest.fixture
def gate(monkeypatch):
    """Hold every background bucket until the test sets the returned event (or the engine closes)."""
    opened = threading.Event()
    build = BackgroundCompile._build

    def held(self, tokens):
        while not opened.wait(0.01) and not self._stop.is_set():
            pass
        build(self, tokens)

    monkeypatch.setattr(BackgroundCompile, "_build", held)
    return opened


def complete_all(client) -> list[str]:
    """Greedy completions of PROMPTS, one request after another."""
    out = []
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        out.append(response.json()["choices"][0]["text"])
    return out


def metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_request_for_a_held_bucket_answers_as_a_compiled_engine(tiny_text_model, gate):
    model_dir, tok_dir = tiny_text_model
    reference = LLM(model_dir, tokenizer=tok_dir, **SETTINGS)  # compile_in_background off offline
    assert reference.runner.background is None
    greedy = SamplingParams(max_tokens=8, temperature=0)
    expected_ids = [
        o.outputs[0].token_ids for o in reference.generate(prompt_token_ids=PROMPTS, sampling_params=greedy)
    ]
    expected = [reference.tokenizer.decode(ids) for ids in expected_ids]
    executables = reference.engine.num_executables()
    reference.close()

    engine = LLMEngine(EngineConfig(model=model_dir, tokenizer=tok_dir, compile_in_background=True, **SETTINGS))
    runner, background = engine.runner, engine.runner.background
    planned = runner.step_shapes()
    assert sorted({k[0] for k in planned}) == [1, 4, 8, 16]
    assert background.ready == (1, 4) and runner.ctx.ready_tokens == (1, 4)
    assert engine.scheduler.max_num_batched_tokens == 4  # prompts chunked to the largest ready bucket
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()
    app = create_app(ServerOptions(served_model_names=("tiny",)), async_engine, shutdown_engine=True)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/health").status_code == 200  # before 8 and 16 are compiled
        assert metric(client, "jaxserve:step_buckets_ready") == 2
        assert metric(client, "jaxserve:step_buckets_total") == 4

        assert complete_all(client) == expected  # 11 and 30 tokens, in 4-token steps
        assert {k[0] for k in runner.table.ran} <= {1, 4}  # only ready buckets ran
        assert not background.order or background.ready == (1, 4)  # still held
        assert runner.unplanned_compiles == 0
        assert metric(client, "jaxserve:compiles_after_warmup_total") == 0

        gate.set()
        assert background.wait(timeout=120)
        assert background.ready == (1, 4, 8, 16) and not background.failed
        assert runner.ctx.ready_tokens is None and engine.scheduler.max_num_batched_tokens == 16
        assert metric(client, "jaxserve:step_buckets_ready") == 4
        assert metric(client, "jaxserve:step_bucket_compile_seconds") > 0

        before = CompileCounter.requests
        assert complete_all(client) == expected  # now in the 16-token bucket
        assert 16 in {k[0] for k in runner.table.ran}
        assert CompileCounter.requests == before  # nothing compiles once all are ready
        assert metric(client, "jaxserve:compiles_after_warmup_total") == 0
        assert runner.unplanned_compiles == 0
        built = collections.Counter(key for key, _ in runner.table.compiled)
        assert set(built) == set(planned) and set(built.values()) == {1}  # each bucket exactly once
        assert engine.num_executables() == executables


def test_close_stops_the_background_compile(tiny_text_model, gate):
    model_dir, tok_dir = tiny_text_model
    llm = LLM(model_dir, tokenizer=tok_dir, compile_in_background=True, **SETTINGS)
    runner, background = llm.runner, llm.runner.background
    assert background.running and background.ready == (1, 4)
    opening = {k for k in runner.step_shapes() if k[0] in (1, 4)}
    start = time.perf_counter()
    llm.close()  # the gate stays shut: close must not wait for it
    assert time.perf_counter() - start < 30 and not background.running
    gate.set()
    assert {key for key, _ in runner.table.compiled} <= opening  # nothing compiled after close
