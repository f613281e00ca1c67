"""StructuredSpec: validation with errors that name the problem, canonical text, hashing."""

import pytest

from jaxserve.errors import RequestError
from jaxserve.structured import GrammarError, StructuredSpec


def test_json_schema_canonical_text_keeps_key_order():
    a = StructuredSpec.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredSpec.json_schema('{"type": "object",\n "properties": {"b": {}, "a": {}}}')
    c = StructuredSpec.json_schema({"type": "object", "properties": {"a": {}, "b": {}}})
    assert a == b and hash(a) == hash(b)
    assert a.text == '{"type":"object","properties":{"b":{},"a":{}}}'
    assert a != c  # property order is output order: a different constraint


def test_options_are_part_of_the_spec():
    s = {"type": "object"}
    assert StructuredSpec.json_schema(s) != StructuredSpec.json_schema(s, strict=False)
    assert StructuredSpec.json_schema(s) != StructuredSpec.json_schema(s, compact_json=False)
    assert StructuredSpec.json_schema(s).compact_json  # compact by default
    assert StructuredSpec.json_object().kind == "json_object"


def test_choice_round_trips():
    s = StructuredSpec.choice(["yes", "no", 'say "hi"\n'])
    assert s.choices() == ["yes", "no", 'say "hi"\n']


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: StructuredSpec.json_schema([1, 2]), "json_schema: a schema must be a JSON object, got an array"),
        (lambda: StructuredSpec.json_schema("{not json"), "json_schema: not valid JSON"),
        (lambda: StructuredSpec.json_schema({"x": float("nan")}), "json_schema: cannot be serialised"),
        (lambda: StructuredSpec.regex(""), "regex: the pattern is empty"),
        (lambda: StructuredSpec.regex(3), "regex: the pattern must be a string, got a number"),
        (lambda: StructuredSpec.choice([]), "choice: the list of choices is empty"),
        (lambda: StructuredSpec.choice("yes"), "choice: expected a list of strings, got a string"),
        (lambda: StructuredSpec.choice(["a", 1]), "choice: item 1 is a number, not a string"),
        (lambda: StructuredSpec.choice(["a", ""]), "choice: item 1 is the empty string"),
        (lambda: StructuredSpec.grammar("  \n"), "grammar: the grammar is empty"),
        (lambda: StructuredSpec("xml", "<a/>"), "unknown structured-output kind 'xml'"),
    ],
)
def test_invalid_specs_name_the_problem(make, message):
    with pytest.raises(GrammarError) as e:
        make()
    assert str(e.value).startswith(message)
    assert isinstance(e.value, RequestError)  # the server's 400 path
