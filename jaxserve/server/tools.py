"""Tool calling on /v1/chat/completions: a request's `tools`, `tool_choice` and `parallel_tool_calls` -> a `ToolPlan`.

- `none` (the default without tools): the tools are still rendered by the chat template (as vLLM
  does), the output is plain content.
- `auto` (the default with tools): the model writes freely; the server's `--tool-call-parser`
  (`tool_parsers.py`) reads its own call format back into `tool_calls`.
- `required`, or `{"type": "function", "function": {"name": ...}}`: the output is generated under
  the grammar of a call array over those functions' parameter schemas
  (`jaxserve.structured.tools`), so every call's arguments validate; read back by the `json_array`
  parser. A named function is called once; `required` makes one call, or up to
  `MAX_PARALLEL_CALLS` with `parallel_tool_calls` (the default).
The 400s name the field: a tool without a function name, a duplicate name, a `parameters` schema
that is not a JSON-schema object or that llguidance refuses, a `tool_choice` naming no given
function, `required` without tools, a forced call beside another output constraint.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from jaxserve.server.errors import APIError
from jaxserve.server.tool_parsers import JsonArrayParser
from jaxserve.structured.errors import GrammarError
from jaxserve.structured.spec import StructuredSpec
from jaxserve.structured.tools import check_parameters_schema, tool_call_spec

__all__ = ["ToolPlan", "normalize_tools", "plan_tools", "template_messages"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclasses.dataclass
class ToolPlan:
    tools: list[dict[str, Any]] | None  # for the chat template, as HF passes them
    choice: str  # "none" | "auto" | "required" | "named"
    parser: str | None  # the tool_parsers name that reads the output; None: plain content
    parallel: bool
    spec: StructuredSpec | None  # the grammar of a forced call


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_tools")


def normalize_tools(tools: list[dict[str, Any]] | None, strict_check: bool = False) -> list[dict[str, Any]] | None:
    """The request's tools, checked: [{"type": "function", "function": {"name", ...}}], names unique."""
    if tools is None:
        return None
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type", "function")
        if kind != "function":
            raise _bad(f"{where}.type {kind!r} is not supported (only 'function')", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(
                f'{where}.function is missing: a tool is {{"type": "function", "function": {{"name", "parameters"}}}}',
                "tools",
            )
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise _bad(f"{where}.function has an unknown field {unknown[0]!r}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.function.name is missing: every tool needs a function name", "tools")
        if not _NAME.match(name):
            raise _bad(f"{where}.function.name {name!r} must be 1-64 letters, digits, '_', '.' or '-'", "tools")
        if name in seen:
            raise _bad(f"{where}.function.name {name!r} is given twice", "tools")
        seen.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description must be a string", "tools")
        if "strict" in fn and not isinstance(fn["strict"], bool):
            raise _bad(f"{where}.function.strict must be a boolean", "tools")
        if "parameters" in fn:
            problem = check_parameters_schema(fn["parameters"], strict=strict_check and fn.get("strict") is not False)
            if problem:
                raise _bad(f"{where}.function.parameters (function {name!r}): invalid schema: {problem}", "tools")
        out.append({"type": "function", "function": dict(fn)})
    return out


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None, parser: str | None
) -> ToolPlan:
    """What to render, constrain and parse for this request (see the module docstring)."""
    choice, named = _choice(tool_choice)
    forced = choice in ("required", "named")
    checked = normalize_tools(tools, strict_check=forced) if tools else None
    if choice is None:
        choice = "auto" if checked else "none"
    parallel = parallel_tool_calls is not False
    if forced and not checked:
        raise _bad(
            f"tool_choice {'required' if choice == 'required' else repr(named)} needs tools, and none were given",
            "tool_choice",
        )
    if choice == "auto" and checked and parser is None:  # the server runs with --no-enable-auto-tool-choice
        raise _bad(
            '"auto" tool choice needs the server started with --enable-auto-tool-choice (and a '
            '--tool-call-parser); send tool_choice "required", a named function or "none"',
            "tool_choice",
        )
    if choice in ("none", "auto") or checked is None:
        return ToolPlan(checked, choice, parser if (choice == "auto" and checked) else None, parallel, None)
    functions = [t["function"] for t in checked]
    if choice == "named":
        functions = [f for f in functions if f["name"] == named]
        if not functions:
            raise _bad(
                f"tool_choice names the function {named!r}, which is not among the tools "
                f"({', '.join(repr(t['function']['name']) for t in checked)})",
                "tool_choice",
            )
        parallel = False
    strict = all(f.get("strict") is not False for f in functions)
    try:
        spec = tool_call_spec(functions, parallel=parallel, strict=strict)
    except GrammarError as err:
        raise _bad(f"tools: {err}", "tools") from None
    return ToolPlan(checked, choice, JsonArrayParser.name, parallel, spec)


def _choice(tool_choice: Any) -> tuple[str | None, str | None]:
    if tool_choice is None:
        return None, None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _bad(
                f"tool_choice {tool_choice!r} is not one of 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        return tool_choice, None
    fn = tool_choice.get("function")
    if tool_choice.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
        raise _bad(
            'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return "named", str(fn["name"])


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The request's messages as the chat template sees them (HF's shapes): an assistant's `tool_calls`
    with their arguments as objects (templates write them with `tojson`), a tool message's
    `tool_call_id`."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            if m.role != "tool":
                raise _bad(f"messages[{i}]: tool_call_id belongs to a tool message, not to {m.role!r}", "messages")
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise _bad(f"messages[{i}]: tool_calls belong to an assistant message, not to {m.role!r}", "messages")
            msg["tool_calls"] = [_history_call(i, j, c) for j, c in enumerate(m.tool_calls)]
        out.append(msg)
    return out


def _history_call(i: int, j: int, call: dict[str, Any]) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn.get("name"):
        raise _bad(f"{where}.function.name is missing", "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise _bad(f"{where}.function.arguments is not JSON: {args[:60]!r}", "messages") from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out
