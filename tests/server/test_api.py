"""API contract of the OpenAI-compatible server, in-process over the deterministic mock engine."""

from __future__ import annotations

import json
import threading
import time

import pytest

from server_testlib import parse_metrics, record_submits, sse_events, wait_until

from jaxserve.sampling.params import SamplingParams
from jaxserve.testing.mock_engine import NUM_SPECIAL, VOCAB_SIZE, MockAsyncLLMEngine

PROMPT = "The quick brown fox"


def complete(client, **body):
    body.setdefault("prompt", PROMPT)
    return client.post("/v1/completions", json=body)


def chat(client, **body):
    body.setdefault("messages", [{"role": "user", "content": "Say something."}])
    return client.post("/v1/chat/completions", json=body)


def stream_events(client, path, body):
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def assert_error(r, status, *needles):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in err["message"] or needle == err["param"], (needle, err)
    return err


# ---- basic shapes --------------------------------------------------------------------------------


def test_health_models_capabilities(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["mock"]
    assert models["data"][0]["max_model_len"] == 512
    caps = client.get("/v1/capabilities").json()
    assert "temperature" in caps["completions"]["fields"] and "messages" in caps["chat_completions"]["fields"]
    assert "suffix" in caps["rejected_parameters"] and "logit_bias" not in caps["rejected_parameters"]
    assert "tools" not in caps["rejected_parameters"] and "tools" in caps["chat_completions"]["fields"]
    assert caps["stream_options"] == ["include_usage"]
    assert caps["response_format"] == ["text", "json_object", "json_schema"]
    # every engine takes every SamplingParams field: nothing is refused for want of engine support
    assert caps["engine_sampling_params"] == sorted(SamplingParams.__dataclass_fields__)
    assert "not_supported_by_engine_yet" not in caps and "n_by" not in caps


def test_completion_fields_and_usage(client):
    r = complete(client, max_tokens=7, temperature=0, ignore_eos=True)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion" and out["model"] == "mock"
    assert isinstance(out["created"], int)
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and len(choice["text"]) == 7
    assert choice["logprobs"] is None
    assert out["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 7, "total_tokens": len(PROMPT) + 7}


def test_greedy_is_deterministic_and_seed_reproducible(client):
    a = complete(client, max_tokens=12, temperature=0).json()["choices"][0]["text"]
    assert complete(client, max_tokens=12, temperature=0).json()["choices"][0]["text"] == a
    s1 = complete(client, max_tokens=12, temperature=0.8, seed=7, ignore_eos=True).json()["choices"][0]["text"]
    s2 = complete(client, max_tokens=12, temperature=0.8, seed=7, ignore_eos=True).json()["choices"][0]["text"]
    s3 = complete(client, max_tokens=12, temperature=0.8, seed=8, ignore_eos=True).json()["choices"][0]["text"]
    assert s1 == s2 and s1 != s3


def test_prompt_forms_and_n(client):
    ids = [4 + b for b in b"hello"]
    by_ids = complete(client, prompt=ids, max_tokens=5, temperature=0).json()
    by_text = complete(client, prompt="hello", max_tokens=5, temperature=0).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    out = complete(client, prompt=["one", "two"], n=2, max_tokens=4, temperature=0.7, seed=1, ignore_eos=True).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 6 and out["usage"]["completion_tokens"] == 16
    out = complete(client, prompt=[ids, ids[:2]], max_tokens=3, temperature=0, ignore_eos=True).json()
    assert len(out["choices"]) == 2 and out["usage"]["prompt_tokens"] == 7


def test_stop_strings(client):
    full = complete(client, max_tokens=40, temperature=0, ignore_eos=True).json()["choices"][0]["text"]
    stop = full[10:12]
    cut = full.index(stop)
    out = complete(client, max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]).json()["choices"][0]
    assert out["text"] == full[:cut] and out["finish_reason"] == "stop"
    out = complete(
        client, max_tokens=40, temperature=0, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    ).json()["choices"][0]
    assert out["text"] == full[: cut + len(stop)]
    events = stream_events(
        client,
        "/v1/completions",
        dict(prompt=PROMPT, max_tokens=40, temperature=0, ignore_eos=True, stop=[stop], stream=True),
    )
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == full[:cut]


def test_logprobs_and_echo(client):
    out = complete(client, max_tokens=5, temperature=0, logprobs=2, ignore_eos=True).json()["choices"][0]
    lp = out["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == out["text"]
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp["top_logprobs"])
    assert lp["text_offset"] == list(range(5))
    echo = complete(client, max_tokens=3, temperature=0, echo=True, ignore_eos=True).json()["choices"][0]
    assert echo["text"].startswith(PROMPT) and len(echo["text"]) == len(PROMPT) + 3
    # lm-eval's loglikelihood call: echo, no new tokens, prompt logprobs
    r = complete(client, max_tokens=0, echo=True, logprobs=1, temperature=0)
    out = r.json()
    assert r.status_code == 200, r.text
    lp = out["choices"][0]["logprobs"]
    assert out["choices"][0]["text"] == PROMPT and out["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(PROMPT) and lp["token_logprobs"][0] is None
    assert all(v is not None and v < 0 for v in lp["token_logprobs"][1:])


def test_echo_of_token_ids_outside_the_vocabulary_is_a_400_not_a_crash(client):
    # Echo decodes the prompt's ids only once the engine has checked them (the fuzz test's case).
    for stream in (False, True):
        r = complete(client, prompt=[VOCAB_SIZE], echo=True, max_tokens=2, stream=stream)
        assert_error(r, 400, "outside the vocabulary")
    assert complete(client, prompt=[VOCAB_SIZE - 1], echo=True, max_tokens=1).status_code == 200


def test_prompt_logprobs(client):
    out = complete(client, prompt="abc", max_tokens=2, prompt_logprobs=1).json()["choices"][0]
    plp = out["prompt_logprobs"]
    assert len(plp) == 3 and plp[0] is None and all(len(e) >= 1 for e in plp[1:])
    assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for e in plp[1:] for v in e.values())
    events = stream_events(client, "/v1/completions", dict(prompt="abc", max_tokens=2, prompt_logprobs=0, stream=True))
    assert events[0]["choices"][0]["prompt_logprobs"][1] is not None
    assert all("prompt_logprobs" not in e["choices"][0] for e in events[1:-1])
    out = chat(client, max_tokens=2, prompt_logprobs=0).json()
    assert out["choices"][0]["prompt_logprobs"][0] is None


def test_chat_basic_and_logprobs(client):
    out = chat(client, max_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3).json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and len(msg["content"]) == 6
    content = out["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == msg["content"]
    assert all(len(c["top_logprobs"]) == 3 for c in content)
    # without max_tokens a chat request may use what is left of max_model_len
    out = chat(client, temperature=0).json()
    assert out["choices"][0]["finish_reason"] in ("stop", "length")


class NonFiniteLogprobsEngine(MockAsyncLLMEngine):
    """The mock engine with logprob entries as a grammar leaves them unfiltered: two alternatives at
    -inf and NaN ("~" and "^", which no prompt here holds), and each prompt token's own logprob -inf."""

    @staticmethod
    def _logprob_entry(digest, k, token, top):
        entry = MockAsyncLLMEngine._logprob_entry(digest, k, token, top)
        entry.update({NUM_SPECIAL + ord("~"): float("-inf"), NUM_SPECIAL + ord("^"): float("nan")})
        if digest.endswith(b"p"):
            entry[token] = float("-inf")
        return entry


def _no_constant(name):
    raise ValueError(f"not JSON: {name}")


def strict_json(text: str):
    """json.loads refusing Infinity, -Infinity and NaN."""
    return json.loads(text, parse_constant=_no_constant)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_that_are_not_finite_never_reach_the_json(make_client, stream):
    """Whatever the engine hands over: alternatives that are not finite are left out of the top lists
    (completions, chat, prompt_logprobs), a token's own -inf is -9999.0; every body is strict JSON."""
    client = make_client(engine_cls=NonFiniteLogprobsEngine)
    bodies = [
        ("/v1/completions", dict(prompt="abc", max_tokens=4, logprobs=5, prompt_logprobs=3, ignore_eos=True)),
        (
            "/v1/chat/completions",
            dict(
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                logprobs=True,
                top_logprobs=5,
                prompt_logprobs=3,
                ignore_eos=True,
            ),
        ),
    ]
    for path, body in bodies:
        r = client.post(path, json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            choices = [c for e in events[:-1] for c in strict_json(e)["choices"]]
        else:
            choices = strict_json(r.text)["choices"]
        assert not any("error" in c for c in choices)
        plp = next(c["prompt_logprobs"] for c in choices if "prompt_logprobs" in c)
        assert plp[0] is None and len(plp) > 1
        for e in plp[1:]:
            assert not {str(NUM_SPECIAL + ord("~")), str(NUM_SPECIAL + ord("^"))} & set(e)
            assert -9999.0 in [v["logprob"] for v in e.values()]
        for c in choices:
            if not c.get("logprobs"):
                continue
            if path == "/v1/completions":
                assert all("~" not in top and "^" not in top for top in c["logprobs"]["top_logprobs"])
                assert all(len(top) == 5 for top in c["logprobs"]["top_logprobs"])
            else:
                for entry in c["logprobs"]["content"]:
                    alts = [a["token"] for a in entry["top_logprobs"]]
                    assert len(alts) == 5 and "~" not in alts and "^" not in alts
                    assert entry["logprob"] > -9999.0


def test_the_servers_json_is_strict():
    from jaxserve.server.errors import dumps

    for bad in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError):
            dumps({"logprob": bad})


# ---- streaming -----------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_equals_non_stream(client, endpoint):
    body = dict(max_tokens=30, temperature=0, ignore_eos=True)
    if endpoint == "chat":
        body["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        path = "/v1/chat/completions"
        whole = client.post(path, json=body).json()["choices"][0]["message"]["content"]
    else:
        body["prompt"] = PROMPT
        path = "/v1/completions"
        whole = client.post(path, json=body).json()["choices"][0]["text"]
    events = stream_events(client, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 30
    assert all(c["usage"] is None for c in chunks)
    if endpoint == "chat":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # without stream_options: no usage key at all, still [DONE]
    plain = stream_events(client, path, {**body, "stream": True})
    assert plain[-1] == "[DONE]" and all("usage" not in c for c in plain[:-1])


def test_stream_n2(client):
    events = stream_events(
        client,
        "/v1/completions",
        dict(prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, stream=True),
    )
    texts = {0: "", 1: ""}
    finished = set()
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"]:
                finished.add(c["index"])
    assert finished == {0, 1} and all(len(t) == 8 for t in texts.values())
    whole = complete(client, n=2, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True).json()
    assert [c["text"] for c in whole["choices"]] == [texts[0], texts[1]]


# ---- the null / unsupported / validation rules ---------------------------------------------------


def test_null_fields_count_as_absent(client):
    r = complete(
        client,
        max_tokens=3,
        temperature=None,
        top_p=None,
        logit_bias=None,
        suffix=None,
        stop=None,
        stream=None,
        user=None,
        seed=None,
        n=None,
        tools=None,
    )
    assert r.status_code == 200, r.text
    r = chat(
        client,
        max_tokens=3,
        tools=None,
        tool_choice=None,
        response_format=None,
        logprobs=None,
        messages=[{"role": "user", "content": "hi", "name": None}],
        stream_options=None,
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "path,extra,field",
    [
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
        ("/v1/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
                ]
            },
            "content",
        ),
        (
            "/v1/chat/completions",
            {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            "continuous_usage_stats",
        ),
    ],
)
def test_unsupported_fields_rejected_by_name(client, path, extra, field):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    body.update(extra)
    body.setdefault("stream", True) if "stream_options" in extra else None
    err = assert_error(client.post(path, json=body), 400)
    assert field in err["message"] and err["code"] == "unsupported_parameter"


def test_response_format_text_is_accepted(client):
    assert chat(client, max_tokens=2, response_format={"type": "text"}).status_code == 200


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": PROMPT, "temperature": 5}, "temperature"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
        ({"prompt": PROMPT, "logprobs": 50}, "logprobs"),
        ({"prompt": PROMPT, "seed": -3}, "seed"),
        ({"prompt": []}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [-1, 2]}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_out_of_range_is_400(client, body, param):
    err = assert_error(client.post("/v1/completions", json=body), 400)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error" and err["code"] == "validation_error"


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "robot", "content": "hi"}]},
        {"messages": [{"role": "user", "content": 3}]},
        {"messages": "hi"},
    ],
)
def test_bad_chat_is_400(client, body):
    err = assert_error(client.post("/v1/chat/completions", json=body), 400)
    assert err["type"] == "invalid_request_error" and err["code"] == "validation_error"


def test_semantic_conflicts_are_400(client):
    assert_error(complete(client, max_tokens=0), 400, "echo")
    assert_error(complete(client, stream_options={"include_usage": True}), 400, "stream_options")
    assert_error(chat(client, top_logprobs=2), 400, "top_logprobs")
    assert_error(complete(client, min_tokens=10, max_tokens=5), 400, "min_tokens")


def test_invalid_json_and_non_object(client):
    r = client.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert_error(r, 400, "JSON")
    r = client.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert assert_error(r, 400)["code"] == "validation_error"


ROUTES = [
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", ROUTES)
def test_validation_errors_are_400_on_every_route(client, path, body, param):
    """As OpenAI and vLLM answer them (FastAPI's default is a 422), with OpenAI's error object, the
    type the other 400s have; a malformed or non-object body likewise."""
    err = assert_error(client.post(path, json=body), 400, param)
    assert err == {
        "message": err["message"],
        "type": "invalid_request_error",
        "param": param,
        "code": "validation_error",
    }
    for content, code in (
        (b'{"x": ', "invalid_json"),
        (b"[1]", "validation_error"),
        (b'"text"', "validation_error"),
        (b"", None),
        (b"null", None),
    ):
        r = client.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, content, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and (code is None or err["code"] == code), err
    r = client.post(path, content=b"prompt=x", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_openapi_documents_400_not_422(client):
    schema = client.get("/openapi.json").json()
    for path, _, _ in ROUTES:
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"
        }, responses
    assert not any("422" in op.get("responses", {}) for ops in schema["paths"].values() for op in ops.values())
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_engine_rejections_are_400(client):
    err = assert_error(complete(client, prompt="x" * 600), 400)
    assert err["code"] == "context_length_exceeded"
    err = assert_error(complete(client, prompt="x" * 500, max_tokens=100), 400)
    assert "512" in err["message"]
    assert_error(complete(client, prompt=[1, 2, 99999]), 400, "vocabulary")
    assert complete(client, max_tokens=2).status_code == 200  # and the server keeps serving


def test_unknown_model_and_route_are_404(client):
    err = assert_error(complete(client, model="gpt-5"), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert complete(client, model="mock", max_tokens=1).status_code == 200
    assert_error(client.get("/v1/nothing-here"), 404)


def test_body_limit_413(make_client):
    client = make_client(max_body_bytes=2000)
    assert_error(complete(client, prompt="y" * 5000), 413)

    def chunked():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"z" * 500
        yield b'"}'

    r = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert_error(r, 413)
    assert complete(client, max_tokens=2).status_code == 200


def test_api_key_401(make_client):
    client = make_client(api_key="sekrit")
    assert_error(complete(client), 401)
    assert_error(client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401)
    assert client.get("/v1/models").status_code == 401
    ok = client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"Authorization": "Bearer sekrit"}
    )
    assert ok.status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_not_ready_is_503():
    from starlette.testclient import TestClient

    from jaxserve.server.api import ServerOptions, create_app

    client = TestClient(create_app(ServerOptions()))
    assert client.get("/health").status_code == 503
    assert_error(client.post("/v1/completions", json={"prompt": "x"}), 503)
    assert client.get("/metrics").status_code == 200


def test_max_waiting_503(make_client):
    client = make_client(token_delay=0.01, settings=dict(max_num_seqs=1), max_waiting=1)
    engine = client.app.state.jaxserve.engine
    results = {}

    def run(name):
        results[name] = complete(client, max_tokens=60, ignore_eos=True, temperature=0).status_code

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    threads[0].start()
    assert wait_until(lambda: engine.stats()["num_running"] == 1, timeout=10)
    threads[1].start()
    assert wait_until(lambda: engine.stats()["num_waiting"] == 1, timeout=10), (
        results,
        engine.stats(),
        client.app.state.jaxserve.pending_first,
    )
    t0 = time.monotonic()
    err = assert_error(complete(client, max_tokens=1), 503)
    assert err["code"] == "queue_full" and time.monotonic() - t0 < 1.0
    for t in threads:
        t.join(timeout=30)
    assert results == {"a": 200, "b": 200}
    assert complete(client, max_tokens=1).status_code == 200
    metrics = parse_metrics(client.get("/metrics").text)
    assert metrics['jaxserve:requests_rejected_total{reason="queue_full"}'] == 1


def test_engine_failure_is_500_and_server_keeps_serving(client):
    err = assert_error(complete(client, prompt="boom <<mock-fail>>", max_tokens=5), 500)
    assert err["type"] == "internal_error"
    assert_error(client.post("/v1/completions", json=dict(prompt="<<mock-fail>>", max_tokens=5, stream=True)), 500)
    # a failure after the first chunk is reported in-band, and the stream still ends with [DONE]
    events = stream_events(client, "/v1/completions", dict(prompt="<<mock-fail-later>>", max_tokens=5, stream=True))
    assert events[-1] == "[DONE]" and "error" in events[-2] and events[-2]["error"]["code"] == "internal_error"
    assert complete(client, max_tokens=3).status_code == 200


def test_mock_engine_delivers_what_it_produced_before_a_failure_to_a_slow_consumer():
    """A failure queued behind outputs a consumer fell behind on comes after them (a busy machine once
    turned the in-band stream error above into a 500)."""
    import asyncio

    from jaxserve.sampling.params import SamplingParams
    from jaxserve.testing.mock_engine import MockAsyncLLMEngine

    engine = MockAsyncLLMEngine(token_delay=0.001)
    engine.start()

    async def consume():
        gen = engine.generate("slow", prompt="<<mock-fail-later>>", sampling_params=SamplingParams(max_tokens=5))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # the request is queued
        time.sleep(0.2)  # the consumer falls behind: its first token and the failure are both queued
        out = await first
        assert len(out.outputs[0].token_ids) == 1 and not out.finished
        with pytest.raises(RuntimeError, match="injected failure"):
            await gen.__anext__()

    try:
        asyncio.run(consume())
    finally:
        engine.shutdown()


def test_every_sampling_field_reaches_the_engine(make_client):
    """The server hands every sampling field to the engine in one SamplingParams per prompt; n is the
    engine's (one engine request yields all n choices), never a server-side fan-out."""
    client = make_client()
    calls = record_submits(client)
    fields = dict(
        n=3,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=1,
        stop=["zz"],
        stop_token_ids=[7],
        min_tokens=1,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        logprobs=2,
        prompt_logprobs=1,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        ignore_eos=True,
    )
    out = complete(client, max_tokens=4, **fields)
    assert out.status_code == 200, out.text
    out = out.json()
    assert len(out["choices"]) == 3 and out["usage"]["completion_tokens"] == 12
    ((params, _),) = calls
    assert isinstance(params, SamplingParams) and params.max_tokens == 4
    expected = {**fields, "stop": ("zz",), "stop_token_ids": (7,)}
    assert {k: getattr(params, k) for k in expected} == expected
    two = complete(client, prompt=["ab", "cd"], n=2, max_tokens=2, ignore_eos=True).json()
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3] and len(calls) == 3  # one engine request a prompt


def test_metrics_exposed(client):
    complete(client, max_tokens=5, ignore_eos=True)
    stream_events(client, "/v1/completions", dict(prompt=PROMPT, max_tokens=5, stream=True, ignore_eos=True))
    text = client.get("/metrics").text
    m = parse_metrics(text)
    for name in (
        "jaxserve:num_requests_running",
        "jaxserve:num_requests_waiting",
        "jaxserve:kv_cache_usage_perc",
        "jaxserve:prefix_cache_hit_rate",
        "jaxserve:num_preemptions_total",
        "jaxserve:prompt_tokens_total",
        "jaxserve:generation_tokens_total",
        "jaxserve:compiles_after_warmup_total",
        "jaxserve:time_to_first_token_seconds_count",
        "jaxserve:time_per_output_token_seconds_count",
        "jaxserve:e2e_request_latency_seconds_count",
        "jaxserve:request_queue_time_seconds_count",
        "jaxserve:kv_pages_used",
        "jaxserve:model_bytes_read_per_second",
    ):
        assert name in m, name
    assert m["jaxserve:e2e_request_latency_seconds_count"] == 2
    assert m["jaxserve:generation_tokens_total"] >= 10
    assert m['jaxserve:http_requests_total{route="/v1/completions",status="200"}'] == 2
    assert m["jaxserve:compiles_after_warmup_total"] == 0


def test_model_bandwidth_utilization_with_known_bandwidth(make_client):
    client = make_client(device_bandwidth=1e9)
    complete(client, max_tokens=3)
    m = parse_metrics(client.get("/metrics").text)
    assert 0 < m["jaxserve:model_bandwidth_utilization"]


def test_openapi_schema_documents_the_api(client):
    schema = client.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "logprobs", "echo", "min_p", "prompt_logprobs"} <= set(props)
    json.dumps(schema)


def test_a_refused_request_is_not_counted_as_aborted(client):
    """A request the engine refuses (a 400 from its checks) is an error, not an abort."""

    def aborted():
        return parse_metrics(client.get("/metrics").text).get(
            'jaxserve:request_finished_total{finish_reason="abort"}', 0
        )

    before = aborted()
    assert_error(complete(client, max_tokens=2, logit_bias={str(VOCAB_SIZE + 5): 1.0}), 400)
    assert complete(client, max_tokens=2).status_code == 200
    assert aborted() == before
