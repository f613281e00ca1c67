"""spec_from_request: the OpenAI and vLLM request fields that constrain output -> one StructuredSpec (or None)."""

from __future__ import annotations

from typing import Any, Mapping

from jaxserve.structured.errors import GrammarError
from jaxserve.structured.spec import StructuredSpec

__all__ = ["spec_from_request", "STRUCTURED_OUTPUT_KEYS", "GUIDED_ALIASES"]

# vLLM's structured_outputs keys, and the older top-level guided_* fields that alias them.
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_ALIASES = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def spec_from_request(
    response_format: Mapping[str, Any] | None = None,
    structured_outputs: Mapping[str, Any] | None = None,
    **guided: Any,
) -> StructuredSpec | None:
    """The one constraint a request asks for, or None for free text.

    response_format: OpenAI's `{"type": "text" | "json_object" | "json_schema", "json_schema":
    {"name", "schema", "strict"}}` (strict defaults to false, as OpenAI's does). structured_outputs:
    vLLM's `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`. guided: vLLM's
    `guided_json=`, `guided_regex=`, `guided_choice=`, `guided_grammar=` (None values are ignored).
    Asking for two constraints at once is a GrammarError naming both fields.
    """
    found: list[tuple[str, StructuredSpec]] = []
    if response_format is not None:
        spec = _from_response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if structured_outputs is not None:
        if not isinstance(structured_outputs, Mapping):
            raise GrammarError("structured_outputs must be an object")
        unknown = sorted(set(structured_outputs) - set(STRUCTURED_OUTPUT_KEYS))
        if unknown:
            raise GrammarError(
                f"structured_outputs: unknown key {unknown[0]!r} (expected one of {', '.join(STRUCTURED_OUTPUT_KEYS)})"
            )
        for key in STRUCTURED_OUTPUT_KEYS:
            value = structured_outputs.get(key)
            if value is not None and value is not False:
                found.append((f"structured_outputs.{key}", _from_vllm(key, value)))
    for name, value in guided.items():
        if name not in GUIDED_ALIASES:
            raise TypeError(f"spec_from_request() got an unexpected field {name!r}")
        if value is not None:
            found.append((name, _from_vllm(GUIDED_ALIASES[name], value)))
    if len(found) > 1:
        raise GrammarError(f"{found[0][0]} and {found[1][0]} both constrain the output; send one of them")
    return found[0][1] if found else None


def _from_response_format(rf: Mapping[str, Any]) -> StructuredSpec | None:
    if not isinstance(rf, Mapping):
        raise GrammarError("response_format must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec.json_object()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping):
            raise GrammarError("response_format.json_schema must be an object with a 'schema'")
        if "schema" not in js:
            raise GrammarError("response_format.json_schema.schema is missing")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError("response_format.json_schema.strict must be a boolean")
        try:
            return StructuredSpec.json_schema(js["schema"], strict=bool(strict))
        except GrammarError as e:
            raise GrammarError(f"response_format.json_schema.schema: {_drop_kind(e)}") from None
    raise GrammarError(f"response_format.type {kind!r} is not one of 'text', 'json_object', 'json_schema'")


def _from_vllm(key: str, value: Any) -> StructuredSpec:
    if key == "json":
        return StructuredSpec.json_schema(value, strict=True)
    if key == "json_object":
        if value is not True:
            raise GrammarError("structured_outputs.json_object must be true")
        return StructuredSpec.json_object()
    if key == "regex":
        return StructuredSpec.regex(value)
    if key == "choice":
        return StructuredSpec.choice(value)
    return StructuredSpec.grammar(value)


def _drop_kind(e: GrammarError) -> str:
    text = str(e)
    return text.split(": ", 1)[1] if text.startswith("json_schema: ") else text
