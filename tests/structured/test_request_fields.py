"""spec_from_request: OpenAI response_format, vLLM structured_outputs and guided_* aliases -> one spec."""

import pytest

from jaxserve.structured import GrammarError, StructuredSpec
from jaxserve.structured.request_fields import spec_from_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_response_format():
    assert spec_from_request(response_format={"type": "text"}) is None
    assert spec_from_request() is None
    assert spec_from_request(response_format={"type": "json_object"}) == StructuredSpec.json_object()
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert spec_from_request(response_format=rf) == StructuredSpec.json_schema(SCHEMA, strict=True)
    rf["json_schema"].pop("strict")
    assert spec_from_request(response_format=rf).strict is False  # OpenAI's default


@pytest.mark.parametrize(
    "kwargs, spec",
    [
        ({"structured_outputs": {"json": SCHEMA}}, StructuredSpec.json_schema(SCHEMA)),
        ({"guided_json": SCHEMA}, StructuredSpec.json_schema(SCHEMA)),
        ({"structured_outputs": {"regex": r"\d+"}}, StructuredSpec.regex(r"\d+")),
        ({"guided_regex": r"\d+"}, StructuredSpec.regex(r"\d+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredSpec.choice(["a", "b"])),
        ({"guided_choice": ["a", "b"]}, StructuredSpec.choice(["a", "b"])),
        ({"structured_outputs": {"grammar": 'start: "x"'}}, StructuredSpec.grammar('start: "x"')),
        ({"guided_grammar": 'start: "x"'}, StructuredSpec.grammar('start: "x"')),
        ({"structured_outputs": {"json_object": True}}, StructuredSpec.json_object()),
        ({"guided_regex": None, "structured_outputs": {"choice": ["a"], "regex": None}}, StructuredSpec.choice(["a"])),
    ],
)
def test_vllm_fields_and_aliases(kwargs, spec):
    assert spec_from_request(**kwargs) == spec


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format and guided_regex both constrain the output; send one of them",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs.regex and structured_outputs.choice both constrain the output",
        ),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs: unknown key 'jsn'"),
        ({"response_format": {"type": "xml"}}, "response_format.type 'xml' is not one of"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema is missing",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema: a schema must be a JSON object, got an array",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
            "response_format.json_schema.strict must be a boolean",
        ),
        ({"guided_choice": []}, "choice: the list of choices is empty"),
    ],
)
def test_bad_fields_name_the_problem(kwargs, message):
    with pytest.raises(GrammarError) as e:
        spec_from_request(**kwargs)
    assert str(e.value).startswith(message), str(e.value)
