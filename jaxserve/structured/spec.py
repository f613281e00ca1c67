"""StructuredSpec: what one request constrains its output to (JSON object, JSON schema, regex, choice, grammar)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal, Sequence

from jaxserve.structured.errors import GrammarError

__all__ = ["KINDS", "Kind", "StructuredSpec"]

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredSpec:
    """A validated, hashable description of a constraint; the compile cache's key.

    `text` is canonical: for json_schema the schema re-serialised compactly with its key order kept
    (property order is the order the model writes them, so two schemas that differ only in key order
    are different constraints); for choice a JSON list of the strings; otherwise the text as given.
    Build one with the classmethods, which check types and say what is wrong.

    strict: json_schema only. True (OpenAI's `strict: true`) refuses a schema that uses keywords the
    library does not implement; False ignores them (the output then validates against a looser schema).
    compact_json: json kinds only. True (the default) allows no whitespace between JSON tokens, so a
    small or weak model cannot loop on spaces until max_tokens; False allows JSON's optional whitespace.
    """

    kind: Kind
    text: str
    strict: bool = True
    compact_json: bool = True
    # The grammar applies after this text (a reasoning model's end of thinking, e.g. "</think>");
    # before it every token but EOS is allowed (structured/reasoning.py). None: from the first token.
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown structured-output kind {self.kind!r} (expected one of {', '.join(KINDS)})")
        if not isinstance(self.text, str):
            raise GrammarError(f"{self.kind}: the spec text must be a string, got {type(self.text).__name__}")
        if self.reasoning_end is not None and (not isinstance(self.reasoning_end, str) or not self.reasoning_end):
            raise GrammarError("reasoning_end must be a non-empty string")

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_object", "json_schema")

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def json_object(cls, *, compact_json: bool = True) -> "StructuredSpec":
        """Any JSON object (`response_format: {"type": "json_object"}`)."""
        return cls("json_object", '{"type":"object"}', compact_json=compact_json)

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any] | bool | str, *, strict: bool = True, compact_json: bool = True
    ) -> "StructuredSpec":
        """A JSON schema, as a dict or as JSON text (`response_format: {"type": "json_schema", ...}`)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"json_schema: not valid JSON: {e}") from None
        if isinstance(schema, bool):  # JSON Schema's true (anything) and false (nothing)
            pass
        elif not isinstance(schema, dict):
            raise GrammarError(f"json_schema: a schema must be a JSON object, got {_json_type(schema)}")
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"json_schema: cannot be serialised as JSON: {e}") from None
        return cls("json_schema", text, strict=bool(strict), compact_json=compact_json)

    @classmethod
    def regex(cls, pattern: str) -> "StructuredSpec":
        r"""The whole output matches `pattern` (Rust `regex` syntax: no look-around, no backreferences;
        \d is ASCII [0-9], \w and \s are Unicode)."""
        if not isinstance(pattern, str):
            raise GrammarError(f"regex: the pattern must be a string, got {_json_type(pattern)}")
        if not pattern:
            raise GrammarError("regex: the pattern is empty")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> "StructuredSpec":
        """The output is exactly one of `choices`."""
        if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
            raise GrammarError(f"choice: expected a list of strings, got {_json_type(choices)}")
        if not choices:
            raise GrammarError("choice: the list of choices is empty")
        for i, c in enumerate(choices):
            if not isinstance(c, str):
                raise GrammarError(f"choice: item {i} is {_json_type(c)}, not a string")
            if not c:
                raise GrammarError(f"choice: item {i} is the empty string")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, text: str) -> "StructuredSpec":
        """A context-free grammar: llguidance's Lark dialect, or llama.cpp's GBNF (converted to Lark)."""
        if not isinstance(text, str):
            raise GrammarError(f"grammar: expected the grammar's text, got {_json_type(text)}")
        if not text.strip():
            raise GrammarError("grammar: the grammar is empty")
        return cls("grammar", text)

    def after_reasoning(self, marker: str | None) -> "StructuredSpec":
        """The same constraint, applied only once the output contains `marker` (None: from the start)."""
        return dataclasses.replace(self, reasoning_end=marker)

    def choices(self) -> list[str]:
        assert self.kind == "choice"
        return json.loads(self.text)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, tuple)):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__
