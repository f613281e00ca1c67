"""Tool calling over HTTP: the 400s, the template's view of tools and history, `auto` parsing of a
scripted model's output (mock engine), streamed and not, and forced calls (`required`, a named
function) on the shipped default model, whose arguments validate against their schemas."""

from __future__ import annotations

import json

import pytest

from jaxserve.loading import resources
from jaxserve.server.chat import ChatRenderer
from jaxserve.testing.mock_engine import MockTokenizer
from server_testlib import ScriptedEngine, default_model_client, sse_chunks

TEMPLATE = (resources.small_checkpoint() / "chat_template.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "enum": ["UTC", "CET", "PST"]},
                "offset": {"type": "integer", "minimum": -12, "maximum": 12},
            },
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def scripted(make_client):
    client = make_client(
        token_delay=0.0005,
        settings=dict(max_model_len=4096, num_pages=2048),
        engine_cls=ScriptedEngine,
        chat_renderer=ChatRenderer(MockTokenizer(), template=TEMPLATE),
    )
    return client, client.mock_engine


def post(client, **body):
    return client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 300, **body})


def accumulate(chunks: list[dict]) -> tuple[str, list[dict], str | None]:
    """A streamed chat response folded back as an OpenAI client folds it."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                slot["id"], slot["name"] = tc["id"], tc["function"]["name"]
                assert tc["type"] == "function" and tc["function"]["arguments"] == ""
            slot["arguments"] += tc["function"].get("arguments", "")
        reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


# ---- bad input: 400s naming the problem, and the server keeps serving -------------------------------


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function"}]}, "tools[0].function is missing"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "'retrieval'"),
        ({"tools": [WEATHER, WEATHER]}, "given twice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "get_stock"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "sometimes"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}},
                        },
                    }
                ]
            },
            "bogus",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "object"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "parameters"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"}, "guided_regex"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "arguments is not JSON",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "assistant"),
    ],
)
def test_bad_tools_are_400s_naming_the_problem(scripted, extra, needle):
    client, _ = scripted
    r = post(client, **extra)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()
    ok = post(client, max_tokens=4)
    assert ok.status_code == 200


def test_tools_on_completions_are_refused_by_name(scripted):
    client, _ = scripted
    r = client.post("/v1/completions", json={"prompt": "x", "tools": [WEATHER]})
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]


# ---- the template sees the tools and the history ----------------------------------------------------


def test_tools_and_tool_history_reach_the_template(scripted):
    client, engine = scripted
    engine.reply = "It is sunny."
    history = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
    ]
    r = post(client, messages=history, tools=[WEATHER])
    assert r.status_code == 200, r.text
    prompt = engine.prompts[-1]
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt  # the tool's signature
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
        in prompt
    )
    assert '<tool_response>\n{"temp": 18}\n</tool_response>' in prompt
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "It is sunny."}
    assert r.json()["choices"][0]["finish_reason"] == "stop"


# ---- auto: the model's own format parsed -------------------------------------------------------------

HERMES_REPLY = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


def test_auto_parses_hermes_calls(scripted):
    client, engine = scripted
    engine.reply = HERMES_REPLY
    r = post(client, tools=[WEATHER, TIME])
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg["tool_calls"])
    one = post(client, tools=[WEATHER, TIME], parallel_tool_calls=False).json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in one["tool_calls"]] == ["get_weather"]


def test_auto_streams_openai_tool_call_deltas(scripted):
    client, engine = scripted
    engine.reply = HERMES_REPLY
    r = post(client, tools=[WEATHER, TIME], stream=True)
    assert r.status_code == 200
    chunks = sse_chunks(r)
    content, calls, reason = accumulate(chunks)
    assert reason == "tool_calls" and content == "Checking."
    whole = post(client, tools=[WEATHER, TIME]).json()["choices"][0]["message"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]
    ]
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert len({c["id"] for c in calls}) == 2


def test_none_and_no_call_leave_the_text_alone(scripted):
    client, engine = scripted
    engine.reply = HERMES_REPLY
    r = post(client, tools=[WEATHER], tool_choice="none").json()["choices"][0]
    assert r["message"] == {"role": "assistant", "content": HERMES_REPLY} and r["finish_reason"] == "stop"
    engine.reply = "No tool needed."
    r = post(client, tools=[WEATHER]).json()["choices"][0]
    assert r["message"] == {"role": "assistant", "content": "No tool needed."} and r["finish_reason"] == "stop"
    engine.reply = HERMES_REPLY  # auto without tools: nothing to call, the text is content
    r = post(client, tool_choice="auto").json()["choices"][0]
    assert r["message"] == {"role": "assistant", "content": HERMES_REPLY}


def test_llama3_json_parser(scripted):
    from starlette.testclient import TestClient

    from jaxserve.server.api import ServerOptions, create_app

    _, engine = scripted
    engine.reply = '{"name": "get_time", "parameters": {"zone": "UTC", "offset": 0}}'
    client = TestClient(
        create_app(ServerOptions(served_model_names=("mock",), tool_call_parser="llama3_json"), engine),
        raise_server_exceptions=False,
    )
    msg = post(client, tools=[TIME]).json()["choices"][0]["message"]
    assert msg["content"] is None and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {
        "zone": "UTC",
        "offset": 0,
    }
    assert client.get("/v1/capabilities").json()["tool_call_parser"] == "llama3_json"


# ---- forced calls on the shipped default model ----------------------------------------------------


@pytest.fixture(scope="module")
def model_client():
    with default_model_client(max_model_len=1024, max_num_batched_tokens=128) as c:
        yield c


def _validate(name: str, arguments: dict) -> None:
    params = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
    props = params["properties"]
    assert set(arguments) <= set(props) and set(params["required"]) <= set(arguments)
    for key, value in arguments.items():
        spec = props[key]
        if "enum" in spec:
            assert value in spec["enum"]
        if spec["type"] == "string":
            assert isinstance(value, str) and len(value) <= spec.get("maxLength", 10**9)
        if spec["type"] == "integer":
            assert isinstance(value, int) and spec["minimum"] <= value <= spec["maximum"]


def test_required_calls_validate_streamed_and_not(model_client):
    for seed in range(3):
        r = post(model_client, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=seed)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None and choice["message"]["tool_calls"]
        for call in choice["message"]["tool_calls"]:
            _validate(call["function"]["name"], json.loads(call["function"]["arguments"]))
    r = post(model_client, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=7, stream=True)
    content, calls, reason = accumulate(sse_chunks(r))
    assert reason == "tool_calls" and content == "" and calls
    for call in calls:
        assert call["id"].startswith("call_")
        _validate(call["name"], json.loads(call["arguments"]))


def test_named_function_is_called_once(model_client):
    r = post(
        model_client,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=1.0,
        seed=3,
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    _validate("get_time", json.loads(call["function"]["arguments"]))
    metrics = model_client.get("/metrics").text  # the masks' host time is exported
    line = next(ln for ln in metrics.splitlines() if ln.startswith("jaxserve:grammar_mask_seconds_total"))
    assert float(line.split()[1]) > 0


def test_a_schema_the_tokenizer_compile_refuses_is_a_400(model_client):
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
                "required": ["a"],
            },
        },
    }
    r = post(model_client, tools=[bad], tool_choice="required")
    assert r.status_code == 400, r.text
    ok = post(model_client, max_tokens=4, temperature=0)
    assert ok.status_code == 200


def test_each_of_n_choices_gets_its_own_calls(scripted):
    client, engine = scripted
    engine.reply = HERMES_REPLY
    r = post(client, tools=[WEATHER, TIME], n=2, temperature=1.0, seed=1)
    choices = r.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["tool_calls", "tool_calls"]
    ids = [call["id"] for c in choices for call in c["message"]["tool_calls"]]
    assert len(ids) == 4 and len(set(ids)) == 4
    streamed = sse_chunks(post(client, tools=[WEATHER, TIME], n=2, temperature=1.0, seed=1, stream=True))
    for index in (0, 1):
        content, calls, reason = accumulate(
            [
                {"choices": [c for c in ch["choices"] if c["index"] == index]}
                for ch in streamed
                if any(c["index"] == index for c in ch["choices"])
            ]
        )
        assert reason == "tool_calls" and [c["name"] for c in calls] == ["get_weather", "get_time"]


def test_tokenize_renders_the_tools_as_chat_does(scripted):
    client, _ = scripted
    plain = client.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    with_tools = client.post("/tokenize", json={"messages": MESSAGES, "tools": [WEATHER]}).json()["count"]
    assert with_tools > plain + 100
    bad = client.post("/tokenize", json={"messages": MESSAGES, "tools": [{"type": "function", "function": {}}]})
    assert bad.status_code == 400 and "tools[0].function.name" in bad.json()["error"]["message"]


def test_the_openai_client_parses_forced_calls_streamed_and_not(model_client):
    """openai's own helpers: `parse` with a strict pydantic tool fills `parsed_arguments`; `stream` folds
    the deltas into the same message shape."""
    import openai
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=20)
        days: int = Field(ge=1, le=7)

    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=model_client, max_retries=0)
    tools = [openai.pydantic_function_tool(GetWeather)]
    done = client.chat.completions.parse(
        model="default",
        messages=MESSAGES,
        tools=tools,
        tool_choice="required",
        max_tokens=300,
        temperature=1.0,
        seed=11,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert all(isinstance(c.function.parsed_arguments, GetWeather) for c in choice.message.tool_calls)
    with client.chat.completions.stream(
        model="default",
        messages=MESSAGES,
        tools=tools,
        tool_choice="required",
        max_tokens=300,
        temperature=1.0,
        seed=12,
    ) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and calls
    assert all(isinstance(c.function.parsed_arguments, GetWeather) and c.id.startswith("call_") for c in calls)
