"""End-to-end: `python -m jaxserve.serve` as a subprocess on a free 127.0.0.1 port, driven by the official
`openai` client (and raw httpx where the client hides what is checked).

The engine behind the server is the `server_args` fixture (tests/server/conftest.py): a tiny random
llama with a trained tokenizer where the real engine imports, else the mock engine.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest

from server_testlib import MAX_MODEL_LEN, MOCK_ARGS, TEST_API_KEY, server_kind, sse_events, wait_until

openai = pytest.importorskip("openai")

GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}


@pytest.fixture(scope="module")
def oai(shared_server):
    return openai.OpenAI(base_url=shared_server.url + "/v1", api_key=TEST_API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def test_completion(oai, model):
    out = oai.completions.create(model=model, prompt="Once upon a time", **GREEDY)
    assert out.object == "text_completion" and out.model == model
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 24
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24
    again = oai.completions.create(model=model, prompt="Once upon a time", **GREEDY)
    assert again.choices[0].text == out.choices[0].text  # greedy is deterministic


def test_chat(oai, model):
    out = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}], **GREEDY)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 24 and out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_text_equals_greedy_text(oai, model, kind):
    if kind == "completion":
        whole = oai.completions.create(model=model, prompt="The meaning of life", **GREEDY).choices[0].text
        chunks = list(
            oai.completions.create(
                model=model, prompt="The meaning of life", stream=True, stream_options={"include_usage": True}, **GREEDY
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why?"}]
        whole = oai.chat.completions.create(model=model, messages=messages, **GREEDY).choices[0].message.content
        chunks = list(
            oai.chat.completions.create(
                model=model, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].choices == []


def test_n2(oai, model):
    out = oai.completions.create(
        model=model, prompt="Pick a word:", n=2, temperature=1.0, seed=11, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.completion_tokens == 16
    same = oai.completions.create(
        model=model, prompt="Pick a word:", n=2, temperature=1.0, seed=11, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in same.choices] == [c.text for c in out.choices]  # seeded


def test_stop(oai, model):
    full = (
        oai.completions.create(
            model=model, prompt="Counting:", temperature=0, max_tokens=48, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    # a two-character stop string from the middle of the text (no whitespace, no U+FFFD)
    candidates = [full[i : i + 2] for i in range(len(full) // 3, len(full) - 1)]
    stop = next(c for c in candidates if c.isprintable() and not any(ch.isspace() or ch == "\ufffd" for ch in c))
    out = oai.completions.create(
        model=model, prompt="Counting:", temperature=0, max_tokens=48, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert out.finish_reason == "stop" and out.text == full[: full.index(stop)]


def test_logprobs(oai, model):
    out = oai.completions.create(
        model=model, prompt="Numbers", temperature=0, max_tokens=6, logprobs=3, extra_body={"ignore_eos": True}
    ).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and all(v <= 0 for v in lp.token_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) >= chosen - 1e-5  # greedy: chosen is the top token
    chat = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


def test_errors_then_next_request_succeeds(oai, model, shared_server):
    cases = [
        (openai.BadRequestError, dict(prompt="x", temperature=-1)),  # a validation error: 400 (OpenAI, vLLM)
        (openai.BadRequestError, dict(prompt="x", top_p=1.5)),
        (openai.BadRequestError, dict(prompt="x", extra_body={"logit_bias_x": 1})),
        (openai.BadRequestError, dict(prompt="x", logit_bias={"5": 101.0})),  # out of [-100, 100]
        (openai.BadRequestError, dict(prompt="x" * 3000)),  # over max_model_len
        (openai.NotFoundError, dict(prompt="x", model="no-such-model")),
    ]
    for error, kwargs in cases:
        kwargs = {"model": model, "max_tokens": 4, **kwargs}
        with pytest.raises(error) as info:
            oai.completions.create(**kwargs)
        assert "error" in info.value.body or info.value.message
        assert oai.completions.create(model=model, prompt="fine", max_tokens=2).usage.completion_tokens >= 1
    r = httpx.post(
        shared_server.url + "/v1/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json", **AUTH},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(shared_server.url + "/v1/completions", json={"prompt": "y" * (9 * 2**20)}, timeout=60, headers=AUTH)
    assert r.status_code == 413
    assert oai.completions.create(model=model, prompt="fine", max_tokens=2).usage.completion_tokens >= 1


def test_client_disconnect_frees_pages(shared_server, model):
    max_tokens = MAX_MODEL_LEN - 20
    body = {
        "model": model,
        "prompt": "A long story:",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    url = shared_server.url
    assert wait_until(lambda: shared_server.metrics()["jaxserve:num_requests_running"] == 0, timeout=30)
    baseline = shared_server.metrics()["jaxserve:kv_pages_used"]
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: ") and line != "data: [DONE]":
                    got += 1
                    if got == 3:
                        break
            during = shared_server.metrics()
            # the request is still decoding when the client leaves
            assert during["jaxserve:num_requests_running"] == 1
            assert during["jaxserve:kv_pages_used"] > baseline
            generated_before = during["jaxserve:generation_tokens_total"]
    # leaving the `with` closed the connection mid-stream
    assert wait_until(lambda: shared_server.metrics()["jaxserve:num_requests_running"] == 0, timeout=30)
    after = shared_server.metrics()
    assert after["jaxserve:kv_pages_used"] == baseline and after["jaxserve:num_requests_waiting"] == 0
    assert after["jaxserve:generation_tokens_total"] - generated_before < max_tokens - 3  # it did not run to the end
    assert after['jaxserve:request_finished_total{finish_reason="abort"}'] >= 1


def test_api_key_enforced(shared_server):
    bad = openai.OpenAI(base_url=shared_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="x", prompt="hi", max_tokens=1)
    assert httpx.post(shared_server.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(shared_server.url + "/health").status_code == 200  # health and metrics stay open
    assert httpx.get(shared_server.url + "/metrics").status_code == 200


def test_sigterm_drains_and_exits_0(start_server):
    """SIGTERM while a streamed response is in flight: it finishes (not cut), the process exits 0, the
    port closes. The signal is sent once the first chunk has arrived, while the client pauses before
    reading the rest: the connection is open then however fast the engine decodes (a tiny real model
    decodes the whole request in ~0.1 s, too fast for a poll of /metrics to find it running),
    though the rest of a short response may already sit in the socket's buffers."""
    server = start_server("--grace-seconds", "60")
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    result = {}
    first_chunk = threading.Event()

    def read_slowly(lines):
        for line in lines:
            yield line
            if line.startswith("data: ") and not first_chunk.is_set():
                first_chunk.set()
                time.sleep(1.0)  # SIGTERM arrives during this pause

    def stream():
        body = {
            "model": model,
            "prompt": "Drain me",
            "max_tokens": MAX_MODEL_LEN - 16,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            result["events"] = sse_events(read_slowly(r.iter_lines()))

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(timeout=60)
    server.proc.send_signal(signal.SIGTERM)
    t.join(timeout=120)
    assert server.proc.wait(timeout=120) == 0, server.log()
    events = result["events"]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"  # finished, not cut
    assert len(events) >= 3  # the first chunk, what came after the pause, [DONE]
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/health", timeout=2)


def test_sigint_idle_exits_0_quickly(start_server):
    server = start_server(engine_args=list(MOCK_ARGS))
    t0 = time.monotonic()
    assert server.stop(signal.SIGINT) == 0
    assert time.monotonic() - t0 < 20


def test_mock_engine_failure_is_500(oai, model):
    if server_kind() != "mock":
        pytest.skip("failure injection is a mock-engine feature")
    with pytest.raises(openai.InternalServerError):
        oai.completions.create(model=model, prompt="<<mock-fail>>", max_tokens=4)
    assert oai.completions.create(model=model, prompt="fine", max_tokens=2).usage.completion_tokens >= 1


def test_metrics_text_format(shared_server):
    text = httpx.get(shared_server.url + "/metrics").text
    assert "# TYPE jaxserve:time_to_first_token_seconds histogram" in text
    assert (
        "# TYPE jaxserve:generation_tokens_total counter" in text or "# TYPE jaxserve:generation_tokens counter" in text
    )
    json.dumps(shared_server.metrics())


def test_start_up_objects_are_frozen_out_of_the_collector(shared_server):
    """Once the engine is up the server freezes what start-up made, so Python's own full collections
    (~400 ms over the default engine's objects) never stall the streams; it says so before /health
    is 200."""
    m = re.search(r"froze (\d+) start-up objects out of the cyclic garbage collector", shared_server.log())
    assert m is not None and int(m.group(1)) > 10_000, shared_server.log()[-2000:]


def test_freezing_the_heap_empties_the_full_collection():
    import gc

    from jaxserve.serve import freeze_startup_heap

    kept = [[i] for i in range(50_000)]  # objects alive "after start-up"
    try:
        frozen, _ = freeze_startup_heap()
        assert frozen >= len(kept)
        assert len(gc.get_objects()) < frozen  # the collector no longer walks them
    finally:
        gc.unfreeze()


def test_tokenize_detokenize_and_logit_bias(oai, model, shared_server):
    """vLLM's /tokenize and /detokenize round-trip on the served tokenizer, and logit_bias +100 forces a
    token at every greedy step (the mock engine ignores the bias: only the real one is checked)."""
    text = "Once upon a time"
    tokens = httpx.post(shared_server.url + "/tokenize", json={"model": model, "prompt": text}, timeout=60).json()
    assert (
        tokens["count"]
        == len(tokens["tokens"])
        == oai.completions.create(model=model, prompt=text, max_tokens=1).usage.prompt_tokens
    )
    back = httpx.post(shared_server.url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=60)
    assert back.status_code == 200 and text in back.json()["prompt"]
    bad = httpx.post(shared_server.url + "/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    forced = tokens["tokens"][-1]
    out = oai.completions.create(
        model=model,
        prompt=text,
        temperature=0,
        max_tokens=6,
        logit_bias={str(forced): 100},
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length"
    if server_kind() == "real":  # each output token is the forced one (its text, as logprobs spell tokens)
        one = httpx.post(shared_server.url + "/detokenize", json={"tokens": [forced]}, timeout=60).json()["prompt"]
        assert out.choices[0].logprobs.tokens == [one] * 6, out.choices[0].logprobs.tokens
