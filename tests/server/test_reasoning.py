"""`--reasoning-parser` over HTTP: `reasoning_content` apart from `content` (streamed and not) on a
scripted model's output (mock engine), tool calls parsed from the content only, and on the shipped
default model a constrained request whose grammar waits for `</think>`."""

from __future__ import annotations

import json

import pytest

from jaxserve.loading import resources
from jaxserve.server.chat import ChatRenderer
from jaxserve.testing.mock_engine import MockTokenizer
from server_testlib import ScriptedEngine, sse_chunks

TEMPLATE = (resources.small_checkpoint() / "chat_template.jinja").read_text()
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture
def scripted(make_client):
    client = make_client(
        token_delay=0.0002,
        settings=dict(max_model_len=4096, num_pages=2048),
        engine_cls=ScriptedEngine,
        chat_renderer=ChatRenderer(MockTokenizer(), template=TEMPLATE),
        reasoning_parser="qwen3",
    )
    return client, client.mock_engine


def post(client, **body):
    return client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 300, **body})


def fold(chunks):
    """(reasoning, content, tool-call names, finish_reason, the order of the delta kinds)."""
    reasoning, content, names, reason, kinds = "", "", [], None, []
    for chunk in chunks:
        for choice in chunk["choices"]:
            d = choice["delta"]
            if d.get("reasoning_content"):
                reasoning += d["reasoning_content"]
                kinds.append("reasoning")
            if d.get("content"):
                content += d["content"]
                kinds.append("content")
            for tc in d.get("tool_calls") or []:
                if "id" in tc:
                    names.append(tc["function"]["name"])
                kinds.append("tool_calls")
            reason = choice["finish_reason"] or reason
    return reasoning, content, names, reason, kinds


def test_reasoning_apart_from_content_streamed_and_not(scripted):
    client, engine = scripted
    engine.reply = "<think>\nTwo and two.\n</think>\n\nIt is 4."
    message = post(client).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Two and two.\n" and message["content"] == "It is 4."
    reasoning, content, _, reason, kinds = fold(sse_chunks(post(client, stream=True)))
    assert (reasoning, content, reason) == ("Two and two.\n", "It is 4.", "stop")
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # every reasoning piece before the content
    assert client.get("/v1/capabilities").json()["reasoning_parser"] == "qwen3"


def test_a_reasoning_that_never_ends_is_all_reasoning(scripted):
    client, engine = scripted
    engine.reply = "<think>I keep thinking"
    message = post(client).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "I keep thinking" and message["content"] is None
    assert fold(sse_chunks(post(client, stream=True)))[:2] == ("I keep thinking", "")


def test_a_closed_think_block_in_the_prompt_means_all_content(scripted):
    client, engine = scripted
    engine.reply = "It is 4. </think> is just text here."
    messages = MESSAGES + [{"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
    r = post(client, messages=messages, continue_final_message=True, add_generation_prompt=False)
    assert engine.prompts[-1].rstrip().endswith("</think>"), engine.prompts[-1]
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] == engine.reply


def test_tool_calls_are_parsed_from_the_content_only(scripted):
    client, engine = scripted
    engine.reply = (
        '<think>Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>? '
        'No: Paris.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>"
    )
    choice = post(client, tools=[WEATHER]).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert "Rome" in choice["message"]["reasoning_content"] and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    reasoning, content, names, reason, _ = fold(sse_chunks(post(client, tools=[WEATHER], stream=True)))
    assert "Rome" in reasoning and content == "" and names == ["get_weather"] and reason == "tool_calls"


def test_no_parser_leaves_the_text_alone(make_client):
    client = make_client()
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5})
    assert "reasoning_content" not in r.json()["choices"][0]["message"]
