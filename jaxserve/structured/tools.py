"""The grammar of forced tool calls (`tool_choice` "required" or a named function), and a check of a tool's schema.

The output is a JSON array of call objects, `[{"name": <one of the functions>, "arguments": <that
function's parameter schema>}, ...]`, as a JSON schema (an `anyOf` over the functions), so the
arguments of every call validate against their function's parameters. Compact like every JSON
output (no whitespace between tokens), so it is also what `jaxserve.server.tool_parsers`'
`json_array` parser reads back.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import llguidance

from jaxserve.structured.spec import StructuredSpec

__all__ = ["check_parameters_schema", "tool_call_schema", "tool_call_spec"]

# With parallel calls the array is still bounded, so a weak model cannot append calls until max_tokens.
MAX_PARALLEL_CALLS = 8


def closed_objects(schema: Any) -> Any:
    """`schema` with every object that lists its properties and says nothing of others closed to them
    (`additionalProperties: false`, as OpenAI's strict function calling requires). JSON Schema lets an
    object without the keyword hold any other property, and a small model forced to call a function
    then invents one (a `description`) and writes it until max_tokens; a function takes its declared
    parameters only. An explicit `additionalProperties` is kept as written."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {key: closed_objects(value) if key in _SUBSCHEMA_KEYS else value for key, value in schema.items()}
    for key in _NAMED_SUBSCHEMA_KEYS:
        if isinstance(schema.get(key), Mapping):
            out[key] = {name: closed_objects(sub) for name, sub in schema[key].items()}
    if isinstance(schema.get("properties"), Mapping):
        out.setdefault("additionalProperties", False)
    return out


_SUBSCHEMA_KEYS = ("items", "anyOf", "oneOf", "allOf", "prefixItems")
_NAMED_SUBSCHEMA_KEYS = ("properties", "$defs", "definitions")


def tool_call_schema(functions: Sequence[Mapping[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of a call array: `functions` are OpenAI function objects ({"name", "parameters"});
    each function's parameters closed to undeclared properties (`closed_objects`)."""
    items = []
    for fn in functions:
        params = fn.get("parameters")
        params = {"type": "object"} if params is None else closed_objects(params)
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    item = items[0] if len(items) == 1 else {"anyOf": items}
    return {"type": "array", "items": item, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}


def tool_call_spec(
    functions: Sequence[Mapping[str, Any]], parallel: bool = True, strict: bool = True
) -> StructuredSpec:
    """The constraint a forced tool call generates under; `strict` refuses keywords the library lacks."""
    return StructuredSpec.json_schema(tool_call_schema(functions, parallel), strict=strict)


def check_parameters_schema(schema: Any, strict: bool = True) -> str | None:
    """What is wrong with a function's `parameters` schema (None: nothing the library sees without a tokenizer).

    A schema must be a JSON object whose type, if given, is "object"; llguidance then compiles it
    (unknown types, bad `$ref`s, under `strict` unimplemented keywords). Bounds that contradict each
    other are found only when compiled for the model's tokenizer (a forced call's 400 comes from there)."""
    if not isinstance(schema, Mapping):
        return "must be a JSON schema object"
    kind = schema.get("type")
    if kind is not None and kind != "object":
        return f"must describe an object (type 'object'), not {kind!r}"
    try:
        text = json.dumps(schema, allow_nan=False)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides={"lenient": not strict})
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
    except (TypeError, ValueError) as err:
        error = str(err)
    if error:
        return error.strip().splitlines()[0]
    return None
