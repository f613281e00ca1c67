"""Structured output over HTTP on the real engine (the shipped default model, in process): response_format
json_schema / json_object, vLLM's structured_outputs and guided_* fields on both routes; bad schemas and
unsupported regex features are 400s that name the problem, and the server keeps serving."""

from __future__ import annotations

import json
import re
import threading

import pytest

from server_testlib import default_model_client

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 12},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Rate the weather as JSON."}]


@pytest.fixture(scope="module")
def client():
    with default_model_client(max_model_len=256, max_num_batched_tokens=64) as c:
        yield c


def chat(client, **extra):
    return client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 120, **extra})


def complete(client, **extra):
    return client.post("/v1/completions", json={"prompt": "The colour is", "max_tokens": 40, **extra})


def test_json_schema_chat_returns_parseable_json(client):
    rf = {"type": "json_schema", "json_schema": {"name": "rating", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        r = chat(client, response_format=rf, temperature=1.0, seed=seed)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        doc = json.loads(choice["message"]["content"])
        assert set(doc) == {"answer", "score"} and 1 <= doc["score"] <= 5 and len(doc["answer"]) <= 12
        assert choice["finish_reason"] == "stop"


def test_json_object_and_streaming(client):
    r = chat(client, response_format={"type": "json_object"}, temperature=0.8, seed=1, max_tokens=200, stream=True)
    assert r.status_code == 200
    text, reason = "", None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content") or ""
            reason = choice.get("finish_reason") or reason
    if reason == "stop":  # a free JSON object may outrun max_tokens; then it is reported as length
        assert isinstance(json.loads(text), dict)
    else:
        assert reason == "length"


def test_vllm_fields_on_completions(client):
    r = complete(client, guided_choice=["sunny", "rainy"], temperature=1.0, seed=2)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("sunny", "rainy")
    r = complete(client, structured_outputs={"regex": r"[A-Z]\d{2}"}, temperature=1.0, seed=3)
    assert re.fullmatch(r"[A-Z]\d{2}", r.json()["choices"][0]["text"]), r.text
    r = complete(client, guided_json=SCHEMA, temperature=1.0, seed=4, max_tokens=120)
    assert set(json.loads(r.json()["choices"][0]["text"])) == {"answer", "score"}
    r = chat(client, guided_regex=r"(yes|no)", temperature=1.0, seed=5)
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")


@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
                            "required": ["a"],
                        },
                    },
                }
            },
            "json_schema",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"guided_regex": r"(a)\1"}, "backreference"),
        ({"guided_regex": r"(?=a)b"}, "look"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_json and guided_regex"),
        ({"structured_outputs": {"jsn": {}}}, "jsn"),
        ({"guided_choice": []}, "empty"),
    ],
)
def test_bad_constraints_are_400s_and_the_server_keeps_serving(client, extra, needle):
    r = chat(client, **extra)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()
    assert r.json()["error"]["code"] == "invalid_structured_output"
    ok = complete(client, max_tokens=4, temperature=0)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_grammars_compile_before_intake_never_on_the_step_thread(client, monkeypatch):
    from jaxserve.structured import GrammarCompiler

    compiler = client.app.state.jaxserve.engine.engine.grammar_compiler
    calls = []

    def compile_on_caller(spec):
        calls.append(threading.current_thread().name)
        return GrammarCompiler.compile(compiler, spec)

    monkeypatch.setattr(compiler, "compile", compile_on_caller)
    misses = compiler.cache_info().misses
    r = complete(client, guided_regex=r"[a-c]{1,4}x", temperature=0)  # a spec no other test sends
    assert r.status_code == 200 and re.fullmatch(r"[a-c]{1,4}x", r.json()["choices"][0]["text"])
    assert calls == [] and compiler.cache_info().misses == misses + 1  # compiled once, by submit


# ---- under --reasoning-parser: the grammar applies after </think> ---------------------------------


def _reasoning_on(client, monkeypatch):
    monkeypatch.setattr(client.app.state.jaxserve.options, "reasoning_parser", "qwen3")


def test_reasoning_parser_closed_think_block_content_parses(client, monkeypatch):
    """The prompt closed the think block (Qwen3's enable_thinking=False): the grammar applies at once."""
    _reasoning_on(client, monkeypatch)
    rf = {"type": "json_schema", "json_schema": {"name": "rating", "schema": SCHEMA, "strict": True}}
    messages = MESSAGES + [{"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
    r = chat(
        client,
        messages=messages,
        continue_final_message=True,
        add_generation_prompt=False,
        response_format=rf,
        temperature=1.0,
        seed=2,
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert choice["message"]["reasoning_content"] is None
    doc = json.loads(choice["message"]["content"])
    assert set(doc) == {"answer", "score"} and 1 <= doc["score"] <= 5


def test_reasoning_parser_open_reasoning_is_not_constrained(client, monkeypatch):
    """The default model never writes </think>: its reasoning is what it writes free (no EOS), never JSON,
    and a reply cut inside the reasoning is finish_reason length with no content."""
    _reasoning_on(client, monkeypatch)
    free = chat(client, temperature=0, max_tokens=16).json()["choices"][0]["message"]["reasoning_content"]
    r = chat(client, temperature=0, max_tokens=16, response_format={"type": "json_object"})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"].startswith(free) and not free.startswith("{")


def test_gated_grammar_on_the_engine_after_the_models_own_marker(client):
    """The engine with a gated spec whose marker the model writes itself (its greedy output's first
    tokens): free text through the marker, then JSON that parses."""
    import asyncio

    from jaxserve.engine.output_processor import OutputAccumulator
    from jaxserve.sampling.params import SamplingParams
    from jaxserve.structured import StructuredSpec

    engine = client.app.state.jaxserve.engine
    prompt = engine.tokenizer.encode("The weather today is")

    async def run(params):
        total = OutputAccumulator()
        async for delta in engine.generate(None, None, params, list(prompt)):
            out = total.add(delta)
        return out.outputs[0]

    free = asyncio.run(run(SamplingParams(temperature=0, max_tokens=4)))
    marker = engine.tokenizer.decode(free.token_ids[:3])
    assert marker.strip()
    spec = StructuredSpec.json_schema(SCHEMA).after_reasoning(marker)
    out = asyncio.run(run(SamplingParams(temperature=0, max_tokens=80, structured=spec)))  # the same first tokens
    assert out.finish_reason == "stop", out
    head, _, answer = out.text.partition(marker)
    assert not head.strip() and out.token_ids[:3] == free.token_ids[:3]
    doc = json.loads(answer)
    assert set(doc) == {"answer", "score"}


# ---- logprobs under a grammar: strict JSON, only allowed tokens -----------------------------------


def _reject_constant(name):
    raise ValueError(f"not JSON: {name}")


def strict_json(text: str):
    """json.loads that refuses Infinity, -Infinity and NaN (which JSON has not, and Python writes)."""
    return json.loads(text, parse_constant=_reject_constant)


def strict_chunks(r) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [strict_json(line) for line in lines[:-1]]
    assert not any("error" in c for c in chunks), chunks
    return chunks


def _allowed(before: str, token: str, docs) -> bool:
    return any(d.startswith(before + token) for d in docs)


YES_NO = ["yes", "no"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_under_a_grammar_are_strict_json(client, stream):
    """guided_choice allows fewer tokens than asked for: the masked ones are left out of top_logprobs
    (once -Infinity in a stream, a 500 otherwise)."""
    r = client.post(
        "/v1/completions",
        json={
            "prompt": "Answer:",
            "max_tokens": 4,
            "guided_choice": YES_NO,
            "logprobs": 5,
            "temperature": 1.0,
            "seed": 1,
            "stream": stream,
        },
    )
    if stream:
        pieces = [c["choices"][0] for c in strict_chunks(r) if c["choices"]]
        text = "".join(p["text"] for p in pieces)
        tokens, token_lps, tops = [], [], []
        for p in pieces:
            if p["logprobs"]:
                tokens += p["logprobs"]["tokens"]
                token_lps += p["logprobs"]["token_logprobs"]
                tops += p["logprobs"]["top_logprobs"]
    else:
        assert r.status_code == 200, r.text
        choice = strict_json(r.text)["choices"][0]
        text, lps = choice["text"], choice["logprobs"]
        tokens, token_lps, tops = lps["tokens"], lps["token_logprobs"], lps["top_logprobs"]
    assert text in YES_NO and "".join(tokens) == text
    before, short = "", 0
    for token, lp, top in zip(tokens, token_lps, tops, strict=True):
        assert lp <= 0 and 1 <= len(top) <= 5 and all(v <= 0 for v in top.values())
        short += len(top) < 5
        assert all(_allowed(before, t, YES_NO) for t in top), (before, top)
        before += token
    assert short  # the grammar allowed fewer than 5 tokens somewhere


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_under_response_format_are_strict_json(client, stream):
    docs = ['"yes"', '"no"']
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"enum": YES_NO}}}
    r = chat(
        client, response_format=rf, logprobs=True, top_logprobs=20, temperature=1.0, seed=3, max_tokens=8, stream=stream
    )
    if stream:
        pieces = [c["choices"][0] for c in strict_chunks(r) if c["choices"]]
        content = "".join(p["delta"].get("content") or "" for p in pieces)
        entries = [e for p in pieces if p["logprobs"] for e in p["logprobs"]["content"]]
    else:
        assert r.status_code == 200, r.text
        choice = strict_json(r.text)["choices"][0]
        content, entries = choice["message"]["content"], choice["logprobs"]["content"]
    assert content in docs and "".join(e["token"] for e in entries) == content
    before = ""
    for e in entries:
        assert -9999.0 < e["logprob"] <= 0 and 1 <= len(e["top_logprobs"]) < 20, e
        assert all(_allowed(before, alt["token"], docs) for alt in e["top_logprobs"]), (before, e)
        before += e["token"]
