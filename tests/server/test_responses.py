"""/v1/responses over the mock engine: the official client's types and helpers, the event sequence and
its indices, a function-tool round trip, previous_response_id and the store's bounds, reasoning items,
and every refusal a 400 naming the field. The shipped model's runs are in test_responses_model.py."""

from __future__ import annotations

import json

import pytest

from jaxserve.loading import resources
from jaxserve.server.chat import ChatRenderer
from jaxserve.testing.mock_engine import EOS_ID, MockAsyncLLMEngine, MockTokenizer

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

TEMPLATE = (resources.small_checkpoint() / "chat_template.jinja").read_text()
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EVENT = TypeAdapter(ResponseStreamEvent)


class Scripted(MockAsyncLLMEngine):
    """The mock engine answering every request with `reply` (then EOS); keeps each prompt's text."""

    reply = ""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts: list[str] = []

    async def submit(self, *args, **kwargs):
        request = args[0]
        ids = getattr(request, "prompt_token_ids", None)
        self.prompts.append(self.tokenizer.decode(ids if ids is not None else args[1], skip_special_tokens=False))
        await super().submit(*args, **kwargs)

    def _token(self, req, sibling, k):
        ids = self.tokenizer.encode(self.reply)
        return ids[k] if k < len(ids) else EOS_ID


@pytest.fixture
def scripted(make_client):
    def make(reasoning_parser=None, **settings):
        client = make_client(
            token_delay=0.0,
            settings=dict(max_model_len=4096, num_pages=2048, **settings),
            engine_cls=Scripted,
            chat_renderer=ChatRenderer(MockTokenizer(), template=TEMPLATE),
            reasoning_parser=reasoning_parser,
        )
        return client, client.mock_engine

    return make


def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)


def sse(response) -> list[dict]:
    """The events of a streamed response; each `event:` line names its data's type."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        kind, data = block.split("\n")
        assert kind == f"event: {json.loads(data[len('data: ') :])['type']}", block
        events.append(json.loads(data[len("data: ") :]))
    return events


def item_text(item: dict) -> str:
    if item["type"] == "function_call":
        return item["arguments"]
    return "".join(part["text"] for part in item["content"])


def check_events(events: list[dict]) -> dict:
    """Every event a client type; sequence numbers 0, 1, ...; each item added at the next output_index,
    its parts, deltas and done events naming its item_id, output_index and content_index 0, the deltas
    adding up to the done texts and to the final response's items. Returns the final response."""
    for event in events:
        EVENT.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete", "response.failed")
    assert {e["response"]["id"] for e in events if "response" in e} == {final["response"]["id"]}
    items: list[dict] = []  # per output_index: {"id", "type", "text", "part", "done"}
    for e in events[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] == len(items) and e["item"]["status"] == "in_progress"
            items.append({"id": e["item"]["id"], "type": e["item"]["type"], "text": "", "part": None, "done": False})
            continue
        slot = items[e["output_index"]]
        assert not slot["done"], e
        if kind != "response.output_item.done":
            assert e["item_id"] == slot["id"], e
        if "content_index" in e:
            assert e["content_index"] == 0, e
        if kind == "response.content_part.added":
            assert slot["part"] is None and slot["type"] in ("message", "reasoning") and e["part"]["text"] == ""
            slot["part"] = "open"
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            assert slot["part"] == "open" and slot["type"] == ("message" if "output" in kind else "reasoning")
            slot["text"] += e["delta"]
        elif kind == "response.function_call_arguments.delta":
            assert slot["type"] == "function_call"
            slot["text"] += e["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert slot["part"] == "open" and e["text"] == slot["text"]
            slot["part"] = "text done"
        elif kind == "response.function_call_arguments.done":
            assert e["arguments"] == slot["text"]
            slot["part"] = "text done"
        elif kind == "response.content_part.done":
            assert slot["part"] == "text done" and e["part"]["text"] == slot["text"]
            slot["part"] = "done"
        elif kind == "response.output_item.done":
            assert slot["part"] == ("text done" if slot["type"] == "function_call" else "done")
            assert e["item"]["id"] == slot["id"] and item_text(e["item"]) == slot["text"]
            assert e["item"]["status"] in ("completed", "incomplete")
            slot["done"] = True
        else:
            raise AssertionError(f"unexpected event {kind}")
    response = final["response"]
    if final["type"] != "response.failed":
        assert all(slot["done"] for slot in items)
        assert [(i["id"], item_text(i)) for i in response["output"]] == [(s["id"], s["text"]) for s in items]
    return response


def same_output(a: dict, b: dict) -> bool:
    """Two responses' outputs and usage alike, ids apart."""

    def shape(r):
        u = r["usage"]
        usage = (
            u["input_tokens"],
            u["output_tokens"],
            u["output_tokens_details"]["reasoning_tokens"],
            u["total_tokens"],
        )
        return (
            [(i["type"], i.get("name"), item_text(i), i["status"]) for i in r["output"]],
            r["status"],
            r["incomplete_details"],
            usage,
        )

    return shape(a) == shape(b)


# ---- the client's create, stream and types; the same text as chat completions ------------------------


def test_create_is_the_chat_completion_of_the_same_conversation(make_client):
    client = make_client(token_delay=0.0, settings=dict(max_model_len=512, num_pages=512))
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Tell me "}, {"type": "input_text", "text": "more."}],
        },
    ]
    r = client.post(
        "/v1/responses",
        json={
            "input": conversation,
            "instructions": "Be brief.",
            "temperature": 0,
            "max_output_tokens": 60,
            "metadata": {"k": "v"},
        },
    )
    assert r.status_code == 200, r.text
    body = Response.model_validate(r.json())  # every field the client's type requires, of its type
    messages = (
        [{"role": "system", "content": "Be brief."}] + conversation[:2] + [{"role": "user", "content": "Tell me more."}]
    )
    chat = client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": 60}).json()
    assert body.output_text == chat["choices"][0]["message"]["content"]
    assert body.status == ("incomplete" if chat["choices"][0]["finish_reason"] == "length" else "completed")
    assert (body.usage.input_tokens, body.usage.output_tokens) == (
        chat["usage"]["prompt_tokens"],
        chat["usage"]["completion_tokens"],
    )
    assert body.usage.total_tokens == chat["usage"]["total_tokens"] and body.metadata == {"k": "v"}
    assert body.id.startswith("resp_") and body.output[0].id.startswith("msg_") and body.temperature == 0
    # the official client: the same response; a string input is one user message
    made = oai(client).responses.create(model="mock", input="Tell me more.", temperature=0, max_output_tokens=60)
    alone = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Tell me more."}], "temperature": 0, "max_tokens": 60},
    ).json()
    assert made.output_text == alone["choices"][0]["message"]["content"] and made.model == "mock"


def test_stream_events_and_the_helpers_final_response(scripted):
    client, engine = scripted()
    engine.reply = "Paris is the capital."
    plain = client.post("/v1/responses", json={"input": "Capital of France?"}).json()
    assert plain["status"] == "completed" and plain["output"][0]["content"][0]["text"] == engine.reply
    final = check_events(sse(client.post("/v1/responses", json={"input": "Capital of France?", "stream": True})))
    assert final["status"] == "completed" and same_output(final, plain)
    with oai(client).responses.stream(model="mock", input="Capital of France?") as stream:
        kinds = [event.type for event in stream]
        helper = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert same_output(helper.model_dump(mode="json"), plain) and helper.output_text == engine.reply


def test_max_output_tokens_makes_it_incomplete(scripted):
    client, engine = scripted()
    engine.reply = "A long answer that goes on."
    r = client.post("/v1/responses", json={"input": "x", "max_output_tokens": 5}).json()
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete" and item_text(r["output"][0]) == "A lon"
    assert r["usage"]["output_tokens"] == 5 and r["completed_at"] is None
    events = sse(client.post("/v1/responses", json={"input": "x", "max_output_tokens": 5, "stream": True}))
    assert events[-1]["type"] == "response.incomplete" and same_output(check_events(events), r)


# ---- tools, reasoning ---------------------------------------------------------------------------------


def test_function_tool_round_trip(scripted):
    client, engine = scripted()
    api = oai(client)
    engine.reply = "Let me check.\n" + CALL
    first = api.responses.create(model="mock", input="Weather in Paris?", tools=[WEATHER])
    message, call = first.output
    assert message.type == "message" and message.content[0].text == "Let me check."
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and first.status == "completed"
    assert first.tools[0].name == "get_weather" and "<tools>" in engine.prompts[-1]
    streamed = check_events(
        sse(client.post("/v1/responses", json={"input": "Weather in Paris?", "tools": [WEATHER], "stream": True}))
    )
    assert same_output(streamed, first.model_dump(mode="json"))
    # the call's output, continuing the stored response; then the same conversation sent whole
    engine.reply = "It is 18 degrees."
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 18}'}
    second = api.responses.create(model="mock", previous_response_id=first.id, input=[output], tools=[WEATHER])
    assert second.output_text == "It is 18 degrees." and second.previous_response_id == first.id
    prompt = engine.prompts[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temp": 18}\n</tool_response>' in prompt
    whole = [{"role": "user", "content": "Weather in Paris?"}] + [i.model_dump(exclude_none=True) for i in first.output]
    api.responses.create(model="mock", input=whole + [output], tools=[WEATHER], store=False)
    assert engine.prompts[-1] == prompt


def test_reasoning_items_streamed_and_not(scripted):
    client, engine = scripted(reasoning_parser="qwen3")
    engine.reply = "<think>\nTwo and two.\n</think>\n\nIt is 4."
    plain = client.post("/v1/responses", json={"input": "2 + 2?"}).json()
    reasoning, message = plain["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "Two and two.\n"}
    ]
    assert item_text(message) == "It is 4." and plain["status"] == "completed"
    assert plain["usage"]["output_tokens_details"]["reasoning_tokens"] == len(
        MockTokenizer().encode("<think>\nTwo and two.\n</think>")
    )
    events = sse(client.post("/v1/responses", json={"input": "2 + 2?", "stream": True}))
    assert same_output(check_events(events), plain)
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    # sent back as input, the reasoning item is accepted and not rendered (templates drop earlier reasoning)
    engine.reply = "5."
    again = client.post(
        "/v1/responses",
        json={
            "input": [{"role": "user", "content": "2 + 2?"}, *plain["output"], {"role": "user", "content": "Plus one?"}]
        },
    )
    assert again.status_code == 200, again.text
    assert "It is 4." in engine.prompts[-1] and "Two and two." not in engine.prompts[-1]


def test_an_engine_failure(make_client):
    client = make_client(token_delay=0.001, settings=dict(max_model_len=512, num_pages=512))
    assert client.post("/v1/responses", json={"input": "<<mock-fail>>"}).status_code == 500
    events = sse(
        client.post("/v1/responses", json={"input": "<<mock-fail-later>>", "max_output_tokens": 8, "stream": True})
    )
    failed = check_events(events)  # what came before the failure, then response.failed
    assert events[-1]["type"] == "response.failed" and failed["status"] == "failed"
    assert failed["error"]["code"] == "server_error" and "injected failure" in failed["error"]["message"]
    assert client.get(f"/v1/responses/{failed['id']}").status_code == 404  # failed responses are not stored
    assert client.post("/v1/responses", json={"input": "x", "max_output_tokens": 2}).status_code == 200


# ---- previous_response_id, GET and DELETE, the store's bounds -----------------------------------------


def test_previous_response_id_continues_the_conversation(scripted):
    client, engine = scripted()
    api = oai(client)
    engine.reply = "Hi Ann."
    first = api.responses.create(model="mock", input="My name is Ann.", instructions="Be brief.")
    engine.reply = "Ann."
    second = api.responses.create(model="mock", input="What is my name?", previous_response_id=first.id)
    assert second.output_text == "Ann."
    prompt = engine.prompts[-1]
    assert "My name is Ann." in prompt and "Hi Ann." in prompt and "What is my name?" in prompt
    assert "Be brief." not in prompt  # instructions are not carried over (as OpenAI)
    assert api.responses.retrieve(second.id).model_dump() == second.model_dump()
    assert client.delete(f"/v1/responses/{first.id}").json() == {"id": first.id, "object": "response", "deleted": True}
    r = client.post("/v1/responses", json={"input": "again", "previous_response_id": first.id})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert first.id in r.json()["error"]["message"]
    assert client.get(f"/v1/responses/{first.id}").status_code == 404
    assert client.delete(f"/v1/responses/{first.id}").status_code == 404
    unstored = client.post("/v1/responses", json={"input": "x", "store": False}).json()
    assert unstored["store"] is False and client.get(f"/v1/responses/{unstored['id']}").status_code == 404


def test_the_store_evicts_by_count_and_age(scripted):
    client, engine = scripted(responses_store_max_entries=2, responses_store_max_age=60)
    store = client.app.state.responses.store
    now = [1000.0]
    store.clock = lambda: now[0]
    engine.reply = "ok"
    ids = [client.post("/v1/responses", json={"input": f"turn {i}"}).json()["id"] for i in range(3)]
    assert client.get(f"/v1/responses/{ids[0]}").status_code == 404  # the oldest, past the count
    r = client.post("/v1/responses", json={"input": "x", "previous_response_id": ids[0]})
    assert r.status_code == 400 and ids[0] in r.json()["error"]["message"] and "evicted" in r.json()["error"]["message"]
    assert client.get(f"/v1/responses/{ids[2]}").status_code == 200
    now[0] += 61
    assert client.get(f"/v1/responses/{ids[2]}").status_code == 404  # past the age
    assert store.evicted == 3 and len(store) == 0


def test_storing_turned_off(scripted):
    client, engine = scripted(responses_store=False)
    engine.reply = "ok"
    r = client.post("/v1/responses", json={"input": "x"})
    assert r.status_code == 200 and r.json()["store"] is False
    assert client.get(f"/v1/responses/{r.json()['id']}").status_code == 404
    refused = (({"store": True}, "store"), ({"previous_response_id": r.json()["id"]}, "previous_response_id"))
    for extra, param in refused:
        bad = client.post("/v1/responses", json={"input": "x", **extra})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param and "--no-responses-store" in bad.text


# ---- refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,param,needle",
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools", "file_search"),
        (
            {
                "tools": [
                    {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"}
                ]
            },
            "tools",
            "computer_use_preview",
        ),
        ({"tools": [dict(WEATHER, defer_loading=True)]}, "tools", "defer_loading"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
        ({"background": True}, "background", "background"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input",
            "input_image",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", "input_file"),
        ({"input": [{"type": "web_search_call", "id": "w", "status": "completed"}]}, "input", "web_search_call"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
        ({"input": []}, "input", "input"),
        ({"conversation": "conv_1"}, "conversation", "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
        ({"include": ["message.output_text.logprobs"]}, "include", "include"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
        ({"truncation": "auto"}, "truncation", "truncation"),
        ({"text": {"verbosity": "low"}}, "text", "verbosity"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
        ({"text": {"format": {"type": "xml"}}}, "text", "xml"),
        ({"service_tier": "flex"}, "service_tier", "service_tier"),
        ({"frobnicate": 1}, "frobnicate", "frobnicate"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id", "resp_nope"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"temperature": 3}, "temperature", "temperature"),
        ({"max_output_tokens": 5000}, "input", "context length"),
    ],
)
def test_refusals_are_400s_naming_the_field(make_client, extra, param, needle):
    client = make_client(token_delay=0.0, settings=dict(max_model_len=512, num_pages=512))
    r = client.post("/v1/responses", json={"input": "x", **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    with pytest.raises(openai.BadRequestError):  # what the client raises
        oai(client).responses.create(model="mock", input="x", extra_body=extra)
    assert client.post("/v1/responses", json={"input": "x", "max_output_tokens": 2}).status_code == 200


def test_the_routes_are_in_the_openapi_schema_and_capabilities(make_client):
    client = make_client(token_delay=0.0)
    paths = client.get("/openapi.json").json()["paths"]  # so the schemathesis fuzzing (test_fuzz.py) covers them
    assert "post" in paths["/v1/responses"] and {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    assert "POST /v1/responses" in client.get("/v1/capabilities").json()["endpoints"]
