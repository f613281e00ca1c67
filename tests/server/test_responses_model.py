"""/v1/responses on real models with the official `openai` client: the shipped default model in process
(greedy text equal to /v1/chat/completions on the same conversation, also across previous_response_id;
`responses.parse` with a pydantic model and `responses.stream` under its schema; a forced function call,
its output, then the answer) and the tiny random model of the session's shared server (greedy text equal
to chat completions, streamed too; `responses.parse`; a forced call, its output, then the answer)."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from server_testlib import TEST_API_KEY, default_model_client, server_kind

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


class Rating(BaseModel):
    answer: str = Field(max_length=12)
    score: int = Field(ge=1, le=5)


GET_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def model_client():
    with default_model_client(max_model_len=512, max_num_batched_tokens=64) as c:
        yield c


def api(http_client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http_client, max_retries=0)


def chat_text(http_client, messages, max_tokens):
    r = http_client.post(
        "/v1/chat/completions",
        json={"model": "default", "messages": messages, "temperature": 0, "max_tokens": max_tokens},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_greedy_text_equals_chat_completions_across_turns(model_client):
    client = api(model_client)
    first = client.responses.create(model="default", input=QUESTION[0]["content"], temperature=0, max_output_tokens=24)
    assert first.output_text and first.output_text == chat_text(model_client, QUESTION, 24)
    second = client.responses.create(
        model="default", input="Now subtract them.", previous_response_id=first.id, temperature=0, max_output_tokens=24
    )
    conversation = QUESTION + [
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Now subtract them."},
    ]
    assert second.output_text == chat_text(model_client, conversation, 24)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_parse_and_stream_a_pydantic_model(model_client):
    client = api(model_client)
    ask = dict(
        model="default", input="Rate the weather as JSON.", text_format=Rating, temperature=0, max_output_tokens=60
    )
    parsed = client.responses.parse(**ask)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Rating)
    with client.responses.stream(**ask) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed and final.output_text == parsed.output_text
    assert final.usage.output_tokens == parsed.usage.output_tokens


def test_forced_function_call_round_trip(model_client):
    client = api(model_client)
    first = client.responses.create(
        model="default",
        input="What is the weather in Paris?",
        tools=[GET_WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    assert all(c.name == "get_weather" and set(json.loads(c.arguments)) == {"city"} for c in calls)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": '{"temp": 18}'} for c in calls]
    answer = client.responses.create(
        model="default",
        input=outputs,
        previous_response_id=first.id,
        tools=[GET_WEATHER],
        tool_choice="none",
        temperature=0,
        max_output_tokens=16,
    )
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    # the same conversation as chat messages gives the same greedy answer
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ],
        },
    ] + [{"role": "tool", "tool_call_id": c.call_id, "content": '{"temp": 18}'} for c in calls]
    r = model_client.post(
        "/v1/chat/completions",
        json={
            "model": "default",
            "messages": history,
            "temperature": 0,
            "max_tokens": 16,
            "tool_choice": "none",
            "tools": [{"type": "function", "function": {k: v for k, v in GET_WEATHER.items() if k != "type"}}],
        },
    )
    assert answer.output_text == r.json()["choices"][0]["message"]["content"]


@pytest.mark.skipif(server_kind() != "real", reason="the shared server runs the mock engine")
def test_the_small_model_matches_chat_completions(shared_server):
    client = openai.OpenAI(base_url=shared_server.url + "/v1", api_key=TEST_API_KEY, max_retries=0, timeout=120)
    model = shared_server.model()
    made = client.responses.create(
        model=model, input="Hello there", instructions="Answer.", temperature=0, max_output_tokens=12
    )
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Answer."}, {"role": "user", "content": "Hello there"}],
        temperature=0,
        max_tokens=12,
    )
    assert made.output_text == chat.choices[0].message.content
    assert made.usage.input_tokens == chat.usage.prompt_tokens
    with client.responses.stream(
        model=model, input="Hello there", instructions="Answer.", temperature=0, max_output_tokens=12
    ) as stream:
        texts = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
    assert texts == made.output_text
    parsed = client.responses.parse(
        model=model, input="Rate it.", text_format=Rating, temperature=0, max_output_tokens=60
    )
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Rating)
    called = client.responses.create(
        model=model, input="Weather?", tools=[GET_WEATHER], tool_choice="required", temperature=0, max_output_tokens=60
    )
    call = next(item for item in called.output if item.type == "function_call")
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    answer = client.responses.create(
        model=model,
        previous_response_id=called.id,
        temperature=0,
        max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18"}],
    )
    assert answer.output[0].type == "message" and answer.usage.input_tokens > called.usage.input_tokens
