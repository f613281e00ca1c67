"""AsyncLLMEngine's intake queue: the event loop never waits for a step.

The engine under the real AsyncLLMEngine is a stand-in whose every step takes STEP_S seconds (a long
prefill, as the SmolLM2-135M shape's is on 2 cores), so the test measures only the async layer: while
a step runs, /health answers, new requests are accepted and aborts return, all within milliseconds.
"""

from __future__ import annotations

import asyncio
import threading
import time
import types

import httpx
import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.intake import Abort, Intake
from jaxserve.engine.processor import Limits, Processor
from jaxserve.errors import RequestError
from jaxserve.sampling.params import CompletionOutput, RequestOutput, SamplingParams
from jaxserve.server.api import ServerOptions, create_app

STEP_S = 1.5
VOCAB = 100


class SlowEngine:
    """The EngineCore interface AsyncLLMEngine uses (through its Overlap, one step deep); each step
    takes STEP_S and gives every request a token."""

    tokenizer = None
    can_overlap = False  # each step runs to completion: Overlap drives schedule, execute, update_from_output
    memory = types.SimpleNamespace(max_model_len=64)  # what AsyncLLMEngine.max_model_len reads
    config = EngineConfig()

    def __init__(self, tokens_per_request: int = 2):
        self.intake = Intake()
        self.requests: dict[str, list[int]] = {}
        self.tokens_per_request = tokens_per_request
        self.in_step = threading.Event()
        self.aborted: list[str] = []
        self.admitted: list[tuple[float, str]] = []  # (time, request id), in admission order

    closed = False
    processor = Processor(Limits(vocab_size=VOCAB, max_model_len=64, page_size=16, usable_pages=64, max_num_seqs=8))

    def take_intake(self) -> list:
        for item in self.intake.take_all():
            if isinstance(item, Abort):
                self.abort_request(item.request_id)
            else:
                self.requests[item.request_id] = []
                self.admitted.append((time.monotonic(), item.request_id))
        return []

    def abort_request(self, request_id: str):
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self):
        return types.SimpleNamespace(rows=list(self.requests))

    def execute(self, batch):
        self.in_step.set()
        time.sleep(STEP_S)
        self.in_step.clear()
        now = time.perf_counter()
        return types.SimpleNamespace(rows=batch.rows, constrained=False, bucket=1, dispatched_at=now, seen_at=now)

    def update_from_output(self, step) -> list[RequestOutput]:
        outputs = []
        for request_id in step.rows:
            tokens = self.requests.get(request_id)
            if tokens is None:  # aborted since
                continue
            tokens.append(7)
            done = len(tokens) >= self.tokens_per_request
            outputs.append(
                RequestOutput(
                    request_id, None, [1], [CompletionOutput(0, list(tokens), "", "length" if done else None)], done
                )
            )
            if done:
                del self.requests[request_id]
        return outputs

    def take_outbox(self) -> list:
        return []

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


async def wait_for_step(engine: SlowEngine) -> None:
    while not engine.in_step.is_set():
        await asyncio.sleep(0.005)


def test_requests_and_aborts_do_not_wait_for_a_running_step():
    async def scenario():
        fake = SlowEngine()
        engine = AsyncLLMEngine(fake)
        first = engine.generate("a", sampling_params=SamplingParams(max_tokens=2), prompt_token_ids=[1, 2])
        first_output = asyncio.ensure_future(first.__anext__())
        await wait_for_step(fake)  # a step is now running, holding the step lock for STEP_S
        t0 = time.monotonic()
        second = engine.generate("b", sampling_params=SamplingParams(max_tokens=2), prompt_token_ids=[3])
        second_output = asyncio.ensure_future(second.__anext__())
        await asyncio.sleep(0)  # the generator runs up to its first wait: checked and queued
        engine.abort("a")
        handed_over = time.monotonic() - t0
        assert fake.in_step.is_set()  # still inside the same step
        # a bad request is refused at once, before the queue (the server's 400), not after the step
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await engine.generate("c", prompt_token_ids=[VOCAB + 5]).__anext__()
        refused = time.monotonic() - t0
        out_a = await first_output  # "a" was in that step: its token arrives, then the abort applies
        out_b = await second_output
        await first.aclose()
        await second.aclose()
        engine.shutdown()
        return handed_over, refused, out_a, out_b, fake

    handed_over, refused, out_a, out_b, fake = asyncio.run(scenario())
    assert handed_over < 0.1 and refused < 0.1, (handed_over, refused)
    assert out_a.request_id == "a" and out_b.request_id == "b"
    assert "a" in fake.aborted and [rid for _, rid in fake.admitted] == ["a", "b"]


def test_health_answers_while_a_step_runs():
    async def scenario():
        fake = SlowEngine(tokens_per_request=3)
        engine = AsyncLLMEngine(fake)
        app = create_app(ServerOptions(served_model_names=("slow",)))
        app.state.jaxserve.set_engine(engine, owned=False)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            body = {"model": "slow", "prompt": [1, 2, 3], "max_tokens": 3}
            long_request = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await wait_for_step(fake)
            step_started = time.monotonic()
            latencies = []
            for _ in range(5):  # while the step runs: health checks, and requests admitted and abandoned
                t = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                latencies.append(time.monotonic() - t)
                abandoned = asyncio.ensure_future(client.post("/v1/completions", json=body))
                await asyncio.sleep(0.02)
                abandoned.cancel()
            accepted = time.monotonic()
            bad = await client.post("/v1/completions", json={**body, "prompt": [VOCAB + 1]})
            bad_answered = time.monotonic()
            still_in_first_step = fake.in_step.is_set() and time.monotonic() - step_started < STEP_S
            response = await long_request
        engine.shutdown()
        return latencies, accepted - step_started, bad, bad_answered - step_started, still_in_first_step, response

    latencies, accepted_after, bad, bad_after, still_in_first_step, response = asyncio.run(scenario())
    assert max(latencies) < 0.25, latencies
    assert accepted_after < STEP_S / 2 and bad_after < STEP_S / 2
    assert still_in_first_step
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
