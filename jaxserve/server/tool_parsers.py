"""Tool-call parsers: a model's generated text -> content and tool calls, on a prefix of it or all of it.

A parser reads the cumulative text of one choice (`parse(text, final)`) and says which part of it
is content and which tool calls it holds so far: each call's name once its string is complete, and
the raw JSON text of its arguments as far as it has been written. Every value a prefix produces is a
prefix of what a longer text produces, so `ToolCallStream` turns successive parses into OpenAI's
streamed deltas by sending only what is new, and the arguments a stream sends add up to exactly the
string a non-streamed response returns (the model's own JSON text, not a re-serialisation).

Formats (`--tool-call-parser`):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, content around them
  (Hermes 2/3, Qwen2.5/3, the shipped default model's template).
- `llama3_json`: Llama 3.1/3.2's JSON format, `{"name": ..., "parameters": {...}}`, several
  separated by `;`, optionally after `<|python_tag|>`; an output that starts with anything but `{`
  is content.
- `json_array` (not a flag: what `tool_choice` "required" or a named function generates under its
  grammar, `jaxserve.structured.tools`): `[{"name": ..., "arguments": {...}}, ...]`.
Both keys `arguments` and `parameters` are read everywhere. A final text whose call region is not a
call (bad JSON, no name) is returned whole as content, with no calls.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Callable, ClassVar

from jaxserve.structured.markers import held_back

__all__ = ["PARSERS", "ParsedCall", "Parsed", "ToolCallStream", "ToolParser", "get_parser", "new_call_id"]

_WS = " \t\r\n"


@dataclasses.dataclass
class ParsedCall:
    name: str | None  # None until the name's string is complete
    arguments: str  # the raw JSON text of the arguments so far ("" until they start)
    complete: bool  # the call's JSON object is closed


@dataclasses.dataclass
class Parsed:
    content: str  # the text outside tool calls (a tail that may become a call's opening is held back)
    calls: list[ParsedCall]


class _Malformed(Exception):
    pass


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """s[i] is '"': the index after the closing quote, None if the string is not closed yet."""
    i += 1
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """The index after the JSON value starting at s[i], None if the text ends inside it."""
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth = 0
        while i < len(s):
            c = s[i]
            if c == '"':
                end = _string_end(s, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(s) else None  # a number or literal may go on until a delimiter follows


def _scan_call(s: str, i: int) -> tuple[ParsedCall, int | None]:
    """The call object starting at s[i] ('{'): what of it is written, and the index after it (None: open).

    Raises _Malformed where the text cannot be a call object."""
    name: str | None = None
    arguments = ""
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return ParsedCall(name, arguments, False), None
        if s[i] == "}":
            return ParsedCall(name, arguments or "{}", True), i + 1
        if s[i] == ",":
            i = _skip_ws(s, i + 1)
            if i >= len(s):
                return ParsedCall(name, arguments, False), None
        if s[i] != '"':
            raise _Malformed(f"expected a key at {i}")
        key_end = _string_end(s, i)
        if key_end is None:
            return ParsedCall(name, arguments, False), None
        key = json.loads(s[i:key_end])
        i = _skip_ws(s, key_end)
        if i >= len(s):
            return ParsedCall(name, arguments, False), None
        if s[i] != ":":
            raise _Malformed(f"expected ':' at {i}")
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            return ParsedCall(name, arguments, False), None
        end = _value_end(s, i)
        raw = s[i:] if end is None else s[i:end]
        if key in ("arguments", "parameters"):
            if raw[0] != "{":
                raise _Malformed("the arguments are not a JSON object")
            arguments = raw
        elif key == "name" and end is not None:
            value = json.loads(raw)
            if not isinstance(value, str) or not value:
                raise _Malformed("the name is not a string")
            name = value
        if end is None:
            return ParsedCall(name, arguments, False), None
        i = end


def _check_complete(call: ParsedCall) -> None:
    if call.name is None:
        raise _Malformed("a call without a name")
    try:
        args = json.loads(call.arguments)
    except ValueError:
        raise _Malformed("arguments that are not JSON") from None
    if not isinstance(args, dict):
        raise _Malformed("arguments that are not an object")


class ToolParser:
    """Parses one model's tool-call format; stateless (every call reads the whole text so far)."""

    name: ClassVar[str]

    def parse(self, text: str, final: bool) -> Parsed:
        try:
            return self._parse(text, final)
        except _Malformed:
            if final:
                return Parsed(text, [])
            return Parsed("", [])  # undecided until the end: hold everything back

    def _parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _parse(self, text: str, final: bool) -> Parsed:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            j = text.find(self.OPEN, pos)
            if j < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - held_back(tail, (self.OPEN,))]
                content.append(tail)
                break
            content.append(text[pos:j])
            start = _skip_ws(text, j + len(self.OPEN))
            close = text.find(self.CLOSE, start)
            body = text[start:] if close < 0 else text[start:close]
            if body and body[0] != "{":
                raise _Malformed("a <tool_call> block that does not hold a JSON object")
            if body:
                call, end = _scan_call(body, 0)
                if (close >= 0 or final) and (end is None or body[end:].strip()):
                    raise _Malformed("a <tool_call> block that is not one JSON object")
                if close >= 0 or final:
                    _check_complete(call)
                calls.append(call)
            elif close >= 0 or final:
                raise _Malformed("an empty <tool_call> block")
            if close < 0:
                break
            pos = close + len(self.CLOSE)
        return Parsed("".join(content), calls)


class _JsonCallsParser(ToolParser):
    """Call objects one after another (llama3_json: `;` between them; json_array: `[a,b]`)."""

    TAGS: tuple[str, ...] = ()
    OPEN = ""
    SEP = ";"
    CLOSE = ""

    def _parse(self, text: str, final: bool) -> Parsed:
        i = _skip_ws(text, 0)
        for tag in self.TAGS:
            if text.startswith(tag, i):
                i = _skip_ws(text, i + len(tag))
            elif not final and tag.startswith(text[i:]) and i < len(text):
                return Parsed("", [])
        if i >= len(text):
            return Parsed(text if final else "", [])
        if self.OPEN:
            if text[i] != self.OPEN:
                return Parsed(text, [])
            i = _skip_ws(text, i + 1)
        if i < len(text) and text[i] != "{":
            return Parsed(text, [])
        calls: list[ParsedCall] = []
        closed = False
        while i < len(text):
            call, end = _scan_call(text, i)
            calls.append(call)
            if end is None:
                break
            _check_complete(call)
            i = _skip_ws(text, end)
            if i >= len(text):
                break
            if self.CLOSE and text[i] == self.CLOSE:
                closed = True
                i = _skip_ws(text, i + 1)
                if i < len(text):
                    raise _Malformed("text after the calls")
                break
            if text[i] != self.SEP:
                raise _Malformed(f"expected {self.SEP!r} between calls")
            i = _skip_ws(text, i + 1)
            if i < len(text) and text[i] != "{":
                raise _Malformed("expected a call object")
        if final:
            if not calls or not calls[-1].complete or (self.CLOSE and not closed):
                raise _Malformed("the calls are not complete")
        return Parsed("", calls)


class Llama3JsonParser(_JsonCallsParser):
    name = "llama3_json"
    TAGS = ("<|python_tag|>",)


class JsonArrayParser(_JsonCallsParser):
    name = "json_array"
    OPEN, SEP, CLOSE = "[", ",", "]"

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = super().parse(text, final)
        if final and not parsed.calls:  # cut by max_tokens: keep the calls that were written
            try:
                return Parsed("", self._parse(text, False).calls)
            except _Malformed:
                pass
        return parsed


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def get_parser(name: str) -> ToolParser:
    if name == JsonArrayParser.name:
        return JsonArrayParser()
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r} (expected one of {', '.join(PARSERS)})") from None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclasses.dataclass
class _Sent:
    id: str
    name: str
    arguments: int = 0  # characters of the arguments sent


class ToolCallStream:
    """One choice's tool calls, streamed: cumulative text in, OpenAI delta dicts out.

    A call's first delta is `{"index", "id", "type": "function", "function": {"name", "arguments": ""}}`,
    later ones `{"index", "function": {"arguments": fragment}}`. Content is sent stripped of
    leading and trailing whitespace (a newline between two calls is not content), as `result` returns it.
    With `parallel` False only the first call is kept."""

    def __init__(self, parser: ToolParser, parallel: bool = True, new_id: Callable[[], str] = new_call_id):
        self.parser = parser
        self.parallel = parallel
        self.new_id = new_id
        self.content_sent = 0
        self.sent: list[_Sent] = []

    def _calls(self, parsed: Parsed) -> list[ParsedCall]:
        named = []
        for c in parsed.calls:  # a call is sent from its name on, in order
            if c.name is None:
                break
            named.append(c)
        return named if self.parallel else named[:1]

    def update(self, text: str, final: bool = False) -> list[dict]:
        parsed = self.parser.parse(text, final)
        deltas: list[dict] = []
        visible = parsed.content.strip()
        if len(visible) > self.content_sent:
            deltas.append({"content": visible[self.content_sent :]})
            self.content_sent = len(visible)
        for index, call in enumerate(self._calls(parsed)):
            if index == len(self.sent):
                self.sent.append(_Sent(self.new_id(), call.name))
                deltas.append(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": self.sent[index].id,
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    }
                )
            sent = self.sent[index]
            if len(call.arguments) > sent.arguments:
                deltas.append(
                    {"tool_calls": [{"index": index, "function": {"arguments": call.arguments[sent.arguments :]}}]}
                )
                sent.arguments = len(call.arguments)
        return deltas

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def result(self, text: str) -> tuple[str | None, list[dict]]:
        """(content or None, tool_calls) of the whole text: what a non-streamed response returns."""
        self.update(text, final=True)
        parsed = self.parser.parse(text, True)
        calls = self._calls(parsed)
        tool_calls = [
            {"id": self.sent[i].id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)
        ]
        return parsed.content.strip() or None, tool_calls
