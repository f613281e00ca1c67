"""Tool-call parsers on canned model outputs: whole, and streamed with the text split at every character.

The streamed deltas must add up to what the non-streamed result returns (content, names, the exact
argument strings), each call's first delta must carry its id, type and name with arguments "", and
nothing may be sent that a longer text takes back."""

from __future__ import annotations

import json

import pytest

from jaxserve.server.tool_parsers import PARSERS, ToolCallStream, get_parser

WEATHER = '{"city": "Paris", "days": 3, "units": ["c", "f"], "note": "a } \\" ] { tricky string"}'

CASES = [
    # (parser, model output, expected content, expected [(name, arguments)])
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
        '{"arguments": {"x": 1.5e3, "y": null, "z": true}, "name": "b.c-d"}\n</tool_call>',
        "Let me look.",
        [("a", "{}"), ("b.c-d", '{"x": 1.5e3, "y": null, "z": true}')],
    ),
    (
        "hermes",
        '<tool_call>{"name": "f", "parameters": {"q": "<tool_call>"}}</tool_call>',
        None,
        [("f", '{"q": "<tool_call>"}')],
    ),
    ("hermes", '<tool_call>\n{"name": "no_args"}\n</tool_call>', None, [("no_args", "{}")]),
    (
        "hermes",
        "Plain answer, no tools. Tags like <tool or <tool_ca stay text.",
        "Plain answer, no tools. Tags like <tool or <tool_ca stay text.",
        [],
    ),
    (
        "hermes",
        'Broken: <tool_call>{"name": 3, "arguments": {}}</tool_call>',
        'Broken: <tool_call>{"name": 3, "arguments": {}}</tool_call>',
        [],
    ),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("hermes", "ends in a tag <tool_c", "ends in a tag <tool_c", []),
    (
        "hermes",
        'Ünïcödé ✓ <tool_call>{"name": "emoji", "arguments": {"s": "🎉 ü"}}</tool_call>',
        "Ünïcödé ✓",
        [("emoji", '{"s": "🎉 ü"}')],
    ),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"k": [1, {"n": 2}]}}; {"name": "b", "arguments": {}}',
        None,
        [("a", '{"k": [1, {"n": 2}]}'), ("b", "{}")],
    ),
    ("llama3_json", "  The answer is 4.", "The answer is 4.", []),
    ("llama3_json", '{"result": 4}', '{"result": 4}', []),
    (
        "llama3_json",
        '{"name": "a", "parameters": {}} trailing words',
        '{"name": "a", "parameters": {}} trailing words',
        [],
    ),
    (
        "json_array",
        '[{"name":"a","arguments":{"q":"x,y]"}},{"name":"b","arguments":{"n":-0.5}}]',
        None,
        [("a", '{"q":"x,y]"}'), ("b", '{"n":-0.5}')],
    ),
    ("json_array", '[{"name":"only","arguments":{}}]', None, [("only", "{}")]),
]


def _stream(parser: str, text: str, cuts, parallel: bool = True):
    """Feed `text` in prefixes ending at `cuts`; return (content, {index: [name, id, arguments]}, deltas)."""
    stream = ToolCallStream(get_parser(parser), parallel=parallel)
    deltas = []
    ends = sorted(set(cuts) | {len(text)})
    for end in ends:
        deltas.extend(stream.update(text[:end], final=end == len(text)))
    content, calls = "", {}
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"} and len(d) == 1
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] not in calls:  # the first delta of a call: OpenAI's header
                assert set(tc) == {"index", "id", "type", "function"}, tc
                assert tc["type"] == "function" and tc["id"].startswith("call_")
                assert tc["function"]["arguments"] == "" and tc["function"]["name"]
                assert tc["index"] == len(calls)
                calls[tc["index"]] = [tc["function"]["name"], tc["id"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                calls[tc["index"]][2] += tc["function"]["arguments"]
    return content, calls, deltas


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_whole_output(parser, text, content, calls):
    got_content, tool_calls = ToolCallStream(get_parser(parser)).result(text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls] == calls
    for c in tool_calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) > 10
        assert isinstance(json.loads(c["function"]["arguments"]), dict)
    assert len({c["id"] for c in tool_calls}) == len(tool_calls)


# A call that turns out malformed only after it was sent cannot be taken back from a stream.
LATE_FAILURE = CASES[13]


@pytest.mark.parametrize("parser,text,content,calls", [c for c in CASES if c is not LATE_FAILURE])
def test_streamed_at_every_split_adds_up_to_the_whole(parser, text, content, calls):
    every = range(1, len(text))  # one character at a time
    got_content, got_calls, _ = _stream(parser, text, every)
    assert got_content == (content or "")
    assert [(name, args) for name, _, args in got_calls.values()] == calls
    for k in range(1, len(text)):  # and in two pieces, split at every position
        got_content, got_calls, _ = _stream(parser, text, [k])
        assert got_content == (content or "") and [(n, a) for n, _, a in got_calls.values()] == calls, k


def test_streamed_at_every_utf8_byte_boundary():
    # The engine's detokenizer releases text only at whole characters; a split inside a character's
    # bytes shows up as a prefix ending before that character.
    text = CASES[8][1]
    data = text.encode()
    prefixes = [len(data[:k].decode("utf-8", errors="ignore")) for k in range(1, len(data))]
    content, calls, _ = _stream("hermes", text, prefixes)
    assert content == "Ünïcödé ✓" and [(n, a) for n, _, a in calls.values()] == [("emoji", '{"s": "🎉 ü"}')]


def test_arguments_stream_in_fragments_after_the_header():
    text = CASES[0][1]
    _, _, deltas = _stream("hermes", text, range(1, len(text)))
    kinds = ["header" if "id" in d["tool_calls"][0] else "args" for d in deltas if "tool_calls" in d]
    assert kinds[0] == "header" and kinds.count("header") == 1 and kinds.count("args") > 10


def test_the_same_ids_streamed_and_returned():
    text = CASES[1][1]
    stream = ToolCallStream(get_parser("hermes"))
    streamed = [tc["id"] for d in stream.update(text, final=True) for tc in d.get("tool_calls", []) if "id" in tc]
    assert [c["id"] for c in stream.result(text)[1]] == streamed


def test_parallel_false_keeps_the_first_call():
    text = CASES[1][1]
    content, calls = ToolCallStream(get_parser("hermes"), parallel=False).result(text)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["a"]
    _, streamed, _ = _stream("hermes", text, range(1, len(text)), parallel=False)
    assert [v[0] for v in streamed.values()] == ["a"]


def test_a_cut_output_keeps_what_was_written():
    # max_tokens in the middle of the second call: the first is whole, the second has its name
    text = '[{"name":"a","arguments":{"q":1}},{"name":"b","arguments":{"z":"w'
    _, calls = ToolCallStream(get_parser("json_array")).result(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("a", '{"q":1}'), ("b", '{"z":"w')]


def test_hermes_content_before_a_call_is_not_held_longer_than_needed():
    stream = ToolCallStream(get_parser("hermes"))
    assert stream.update("Hello <tool") == [{"content": "Hello"}]
    assert stream.update("Hello <tool_call>") == []
    assert stream.update('Hello <tool_call>{"name": "f"')[0]["tool_calls"][0]["function"]["name"] == "f"


def test_registry():
    assert set(PARSERS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_parser("mistral")


def test_a_call_that_fails_late_stays_sent_and_the_text_follows_as_content():
    parser, text, content, _ = LATE_FAILURE
    got_content, calls, _ = _stream(parser, text, range(1, len(text)))
    assert got_content == content and [(n, a) for n, _, a in calls.values()] == [("a", "{}")]
