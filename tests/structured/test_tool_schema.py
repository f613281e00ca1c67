"""A forced tool call's grammar: each function's arguments hold its declared parameters only, unless
its schema says otherwise, at every depth."""

import json

import llguidance

from jaxserve.structured.tools import closed_objects, tool_call_schema

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "required": ["city"],
        "properties": {
            "city": {"type": "string"},
            "when": {"type": "object", "properties": {"day": {"type": "integer"}}},
            "stops": {"type": "array", "items": {"type": "object", "properties": {"at": {"type": "string"}}}},
            "extra": {"type": "object", "properties": {"k": {}}, "additionalProperties": True},
        },
    },
}


def accepts(schema, value) -> bool:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer())), grammar)
    return not matcher.is_error() and matcher.consume_tokens(list(json.dumps(value, separators=(",", ":")).encode()))


class _ByteTokenizer:
    """The smallest llguidance tokenizer: one token per byte, so any text can be offered byte by byte."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text.encode())


def test_undeclared_properties_are_refused_at_every_depth_unless_allowed():
    schema = tool_call_schema([WEATHER])
    call = {
        "name": "get_weather",
        "arguments": {"city": "Oslo", "when": {"day": 3}, "stops": [{"at": "x"}], "extra": {"k": 1, "more": 2}},
    }
    assert accepts(schema, [call])  # "extra" allows others, as its schema says
    for bad in (
        {"city": "Oslo", "description": "..."},
        {"city": "Oslo", "when": {"day": 3, "hour": 1}},
        {"city": "Oslo", "stops": [{"at": "x", "why": "y"}]},
    ):
        assert not accepts(schema, [{"name": "get_weather", "arguments": bad}]), bad


def test_closed_objects_keeps_what_the_schema_says_and_follows_defs():
    assert closed_objects({"type": "object", "properties": {}, "additionalProperties": {"type": "string"}}) == {
        "type": "object",
        "properties": {},
        "additionalProperties": {"type": "string"},
    }
    closed = closed_objects(
        {
            "$defs": {"D": {"type": "object", "properties": {"q": {}}}},
            "type": "object",
            "properties": {"d": {"$ref": "#/$defs/D"}},
        }
    )
    assert closed["$defs"]["D"]["additionalProperties"] is False and closed["additionalProperties"] is False
    assert closed_objects({"type": "string"}) == {"type": "string"}
