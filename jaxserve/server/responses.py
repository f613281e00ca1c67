"""`POST /v1/responses` (OpenAI's Responses API, as vLLM serves it), `GET` and `DELETE /v1/responses/{id}`.

A Responses request is translated into the chat completion it means and runs on the chat path: its
`instructions` become a system message, its `input` items chat messages (a `function_call` joins the
assistant message before it as a tool call, a `function_call_output` is a tool message), its
function `tools` and `tool_choice` the chat tools, `text.format` the `response_format`,
`max_output_tokens` the `max_tokens`; `requests.translate` then renders the chat template, tokenizes,
builds the SamplingParams (the grammar of a schema or a forced call included) and gives the 400s, and
the engine requests, the metrics, the tool-call and reasoning parsers are those of
/v1/chat/completions (`streaming.py`). Only the assembly differs: `responses_stream.OutputItems`
turns the choice's reasoning, text and calls into output items, and `stream: true` sends the
Responses event sequence.

`previous_response_id` continues a stored response: its conversation (input and output, without its
instructions, as OpenAI does) comes before this request's input. Responses are stored unless the
request says `store: false` or the server runs `--no-responses-store` (`response_store.py` has the
bounds). What is not supported is a 400 naming the field: built-in tools, file/image/audio inputs,
`background`, and the other fields `responses_protocol.RESPONSES_UNSUPPORTED` lists; an unknown,
deleted or evicted `previous_response_id` is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from jaxserve.server.embeddings import refuse_generation
from jaxserve.server.errors import APIError, engine_error
from jaxserve.server.protocol import ChatCompletionRequest
from jaxserve.server.reasoning_parsers import ReasoningStream
from jaxserve.server.requests import GenerationRequest, translate
from jaxserve.server.response_store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_ENTRIES, ResponseStore, StoredResponse
from jaxserve.server.responses_protocol import RESPONSES_SAMPLING, DeletedResponse, ResponseObject, ResponsesRequest
from jaxserve.server.responses_stream import OutputItems, item_status, response_status, stream_events
from jaxserve.server.streaming import (
    Choice,
    ResponseAssembler,
    SSEResponse,
    Submission,
    _ClientGone,
    race_disconnect,
    start_fanout,
)
from jaxserve.server.tool_parsers import ToolCallStream, get_parser

if TYPE_CHECKING:
    from jaxserve.server.state import ServerState

logger = logging.getLogger(__name__)

__all__ = ["RESPONSES_ROUTE", "ResponsesService", "add_responses_routes", "input_messages"]

RESPONSES_ROUTE = "/v1/responses"

# Item types of OpenAI's built-in tools (and other server-side features): refused by name.
_BUILTIN_ITEMS = (
    "file_search_call",
    "computer_call",
    "computer_call_output",
    "web_search_call",
    "image_generation_call",
    "code_interpreter_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
    "custom_tool_call",
    "custom_tool_call_output",
    "tool_search_call",
    "tool_search_output",
    "compaction",
    "compaction_trigger",
    "item_reference",
    "program",
    "program_output",
    "additional_tools",
    "configuration_update",
)
_MEDIA_PARTS = {
    "input_image": "image inputs are not supported (no vision model is served)",
    "input_file": "file inputs are not supported",
    "input_audio": "audio inputs are not supported",
}
# The keys each input item may carry (what the client sends back of a response's output items included).
_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "id", "call_id", "name", "arguments", "status"},
    "function_call_output": {"type", "id", "call_id", "output", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
_PART_KEYS = {"type", "text", "annotations", "logprobs"}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}


def _bad(message: str, param: str, code: str = "invalid_request") -> APIError:
    return APIError(400, message, param=param, code=code)


def _unsupported(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


# ---- a Responses request -> the chat completion it means ------------------------------------------


def _no_nulls(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if v is not None}


def _parts_text(content: Any, where: str, param: str = "input") -> str:
    """A message's content (a string or text parts) as one string; media parts are refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _bad(f"{at} must be an object with a 'type'", param)
        part = _no_nulls(part)
        kind = part.get("type")
        if kind in _MEDIA_PARTS:
            raise _unsupported(f"{at}.type {kind!r}: {_MEDIA_PARTS[kind]}", param)
        if kind not in ("input_text", "output_text"):
            raise _unsupported(f"{at}.type {kind!r} is not supported (only 'input_text' and 'output_text')", param)
        extra = sorted(set(part) - _PART_KEYS)
        if extra:
            raise _unsupported(f"{at} has an unsupported field {extra[0]!r}", param)
        if not isinstance(part.get("text"), str):
            raise _bad(f"{at}.text must be a string", param)
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise _bad(f"{where}.{key} must be a non-empty string", "input")
    return value


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat-message dicts (see the module docstring); a 400 naming the item it cannot take."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        item = _no_nulls(item)
        kind = item.get("type", "message")
        if kind in _BUILTIN_ITEMS:
            raise _unsupported(
                f"{where}.type {kind!r} belongs to a built-in tool or server-side feature, which "
                "jaxserve does not support (only function tools)",
                "input",
            )
        if kind not in _ITEM_KEYS:
            raise _bad(f"{where}.type {kind!r} is not one of {', '.join(map(repr, _ITEM_KEYS))}", "input")
        extra = sorted(set(item) - _ITEM_KEYS[kind])
        if extra:
            raise _unsupported(f"{where} ({kind}) has an unsupported field {extra[0]!r}", "input")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role {role!r} is not one of 'user', 'system', 'developer', 'assistant'", "input")
            if "content" not in item:
                raise _bad(f"{where}.content is missing", "input")
            messages.append({"role": role, "content": _parts_text(item["content"], f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the text before it, or an earlier call
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if "output" not in item:
                raise _bad(f"{where}.output is missing", "input")
            message = {"role": "tool", "content": _parts_text(item["output"], f"{where}.output")}
            if "call_id" in item:
                message["tool_call_id"] = _string(item, "call_id", where)
            messages.append(message)
        # reasoning items are accepted and not rendered: chat templates drop earlier turns' reasoning
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type": "function", "name", ...}) as chat tools; any other type is refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        tool = _no_nulls(tool)
        kind = tool.get("type")
        if kind != "function":
            raise _unsupported(
                f"tools[{i}].type {kind!r} is not supported: only function tools (built-in tools such "
                "as web_search, file_search or computer use are not served)",
                "tools",
            )
        extra = sorted(set(tool) - _TOOL_KEYS)
        if extra:
            raise _unsupported(f"tools[{i}] has an unsupported field {extra[0]!r}", "tools")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice  # "none" | "auto" | "required"; anything else is tools.py's 400
    kind = choice.get("type")
    if kind != "function" or not isinstance(choice.get("name"), str):
        raise _unsupported(
            f"tool_choice {choice!r} is not supported: give 'none', 'auto', 'required' or "
            '{"type": "function", "name": ...}',
            "tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (None: free text)."""
    text = _no_nulls(text or {})
    extra = sorted(set(text) - {"format"})
    if extra:
        raise _unsupported(f"text.{extra[0]} is not supported", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format must be an object with a 'type'", "text")
    fmt = _no_nulls(fmt)
    kind = fmt.get("type")
    allowed = {
        "text": {"type"},
        "json_object": {"type"},
        "json_schema": {"type", "name", "schema", "strict", "description"},
    }.get(kind)
    if allowed is None:
        raise _bad(f"text.format.type {kind!r} is not one of 'text', 'json_object', 'json_schema'", "text")
    extra = sorted(set(fmt) - allowed)
    if extra:
        raise _unsupported(f"text.format ({kind}) has an unsupported field {extra[0]!r}", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.get("name"), str) or "schema" not in fmt:
        raise _bad("text.format (json_schema) needs a 'name' and a 'schema'", "text")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request that `body` means, over `messages`."""
    values: dict[str, Any] = {name: getattr(body, name) for name in RESPONSES_SAMPLING}
    values.update(
        messages=messages,
        model=body.model,
        max_tokens=body.max_output_tokens,
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format(body.text),
    )
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise _bad(f"input: {where}: {first.get('msg')}" if where else f"input: {first.get('msg')}", "input") from None


# Chat's names of the fields, in translate's 400s -> this route's
_PARAM_NAMES = {"messages": "input", "response_format": "text", "max_tokens": "max_output_tokens"}


def _translated(state: ServerState, chat: ChatCompletionRequest, rid: str, lora_request: Any) -> GenerationRequest:
    try:
        return translate(state, chat, chat=True, request_id=rid, lora_request=lora_request)
    except APIError as err:
        if err.param in _PARAM_NAMES:
            err.param = _PARAM_NAMES[err.param]
            err.message = err.message.replace("response_format.json_schema.", "text.format.")
        raise


# ---- usage and the response object ------------------------------------------------------------------


def reasoning_tokens(state: ServerState, job: GenerationRequest, ids: list[int], reasoning: str) -> int:
    """Output tokens up to and including the end of the reasoning (`</think>`): the shortest prefix of
    the output whose text holds the end marker (a binary search over decoded prefixes); all of them
    when the output never closed its reasoning."""
    tok = state.tokenizer
    if not reasoning or job.reasoning is None or tok is None:
        return 0
    end = job.reasoning.end
    if end not in tok.decode(ids):
        return len(ids)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if end in tok.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


class _Pending:
    """One response being made: what its response object echoes of the request."""

    def __init__(self, body: ResponsesRequest, rid: str, model: str, job: GenerationRequest, stored: bool):
        self.body, self.rid, self.model, self.job, self.stored = body, rid, model, job, stored
        self.created = int(time.time())
        tools = [
            {
                "type": "function",
                "name": t["name"],
                "description": t.get("description"),
                "parameters": t.get("parameters"),
                "strict": t.get("strict"),
            }
            for t in body.tools or ()
        ]
        self.echo = {
            "tools": tools,
            "tool_choice": body.tool_choice or ("auto" if tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        }

    def obj(self, status: str, output: list[dict] | None = None, usage: dict | None = None) -> dict[str, Any]:
        body, params = self.body, self.job.params
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": self.model,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "output": output or [],
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "store": self.stored,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
            **self.echo,
        }


def _usage(
    state: ServerState, job: GenerationRequest, assembler: ResponseAssembler, choice: Choice, items: OutputItems
) -> dict[str, Any]:
    counts = assembler.usage()
    reasoning = reasoning_tokens(state, job, list(choice.token_ids), items.reasoning_text)
    return {
        "input_tokens": counts["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": counts["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": counts["total_tokens"],
    }


def _output_message(items: OutputItems) -> dict[str, Any] | None:
    """The response's output as the assistant message a follow-up's chat template sees."""
    text = items.message.text if items.message is not None else ""
    calls = [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.text or "{}"}}
        for c in items.items
        if c.kind == "function_call"
    ]
    if not text and not calls:
        return None
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def _choice(job: GenerationRequest, sub: Submission) -> Choice:
    """The response's one choice, read by the chat route's parsers (as streaming.respond sets them up)."""
    choice = Choice(0, sub, "", False)
    if job.tools is not None and job.tools.parser is not None:
        choice.tools = ToolCallStream(get_parser(job.tools.parser), parallel=job.tools.parallel)
    if job.reasoning is not None:
        choice.reasoning = ReasoningStream(job.reasoning, job.reasoning_open)
    return choice


# ---- the routes -------------------------------------------------------------------------------------


class ResponsesService:
    """The routes' state: the store, made on first use from the engine's settings."""

    def __init__(self, state: ServerState):
        self.state = state
        self._store: ResponseStore | None = None

    @property
    def enabled(self) -> bool:
        config = self.state.engine.config if self.state.engine is not None else None
        return getattr(config, "responses_store", True)

    @property
    def store(self) -> ResponseStore:
        if self._store is None:
            config = self.state.engine.config if self.state.engine is not None else None
            self._store = ResponseStore(
                getattr(config, "responses_store_max_entries", DEFAULT_MAX_ENTRIES),
                getattr(config, "responses_store_max_age", DEFAULT_MAX_AGE_S),
            )
        return self._store

    def previous(self, response_id: str | None) -> StoredResponse | None:
        if response_id is None:
            return None
        if not self.enabled:
            raise _bad(
                "previous_response_id needs stored responses, and this server runs with --no-responses-store",
                "previous_response_id",
                "previous_response_not_found",
            )
        stored = self.store.get(response_id)
        if stored is None:
            raise _bad(
                f"previous_response_id {response_id!r} is not stored here: unknown, deleted, or evicted (the "
                f"store keeps {self.store.max_entries} responses for {self.store.max_age_s:g} s)",
                "previous_response_id",
                "previous_response_not_found",
            )
        return stored

    def lookup(self, response_id: str) -> StoredResponse:
        stored = self.store.get(response_id) if self.enabled else None
        if stored is None:
            raise APIError(
                404,
                f"no stored response {response_id!r} (unknown, deleted, evicted, or created with store: false)",
                type="not_found_error",
                param="response_id",
                code="response_not_found",
            )
        return stored

    async def create(self, request: Request, body: ResponsesRequest) -> Response:
        state = self.state
        arrival = time.monotonic()
        state.check_ready()
        refuse_generation(state)  # a pooling server serves /v1/embeddings only
        model, lora_request = state.check_model(body.model)
        if body.store and not self.enabled:
            raise _unsupported("store: true, but this server runs with --no-responses-store", "store")
        stored = self.enabled and body.store is not False
        previous = self.previous(body.previous_response_id)
        history = (list(previous.messages) if previous is not None else []) + input_messages(body.input)
        system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        chat = chat_request(body, system + history)
        rid = f"resp_{uuid.uuid4().hex}"
        job = _translated(state, chat, rid, lora_request)
        await state.check_queue()
        if body.user or body.safety_identifier:
            logger.debug("%s: user %r", rid, body.user or body.safety_identifier)
        sub = Submission(job.requests[0], 0, 0, arrival=arrival)
        fan = await start_fanout(state, request, [sub])
        if fan is None:
            return Response(status_code=499)

        choice = _choice(job, sub)
        assembler = ResponseAssembler(state, rid, model, job, [sub], {0: choice}, chat)
        items = OutputItems(choice)
        pending = _Pending(body, rid, model, job, stored)

        def build(status: str) -> dict[str, Any]:
            if status in ("in_progress", "failed"):
                return pending.obj(status, items.output() if status == "failed" else [])
            return pending.obj(status, items.output(), _usage(state, job, assembler, choice, items))

        def keep(final: dict[str, Any]) -> None:
            if stored:
                message = _output_message(items)
                self.store.put(rid, final, history + ([message] if message is not None else []))

        if body.stream:
            return SSEResponse(
                stream_events(fan, assembler, items, build, keep),
                on_close=fan.close,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            await race_disconnect(assembler.collect(fan), request)
        except _ClientGone:
            return Response(status_code=499)
        except (APIError, asyncio.CancelledError):
            raise
        except BaseException as err:  # noqa: BLE001 - the engine failed this request: its status
            raise engine_error(err) from None
        finally:
            fan.close()
        items.advance(choice.text, final=True)
        items.finish(item_status(choice.finish_reason))
        final = build(response_status(choice.finish_reason))
        keep(final)
        return JSONResponse(final)


def add_responses_routes(app: FastAPI, state: ServerState, err_responses: dict) -> ResponsesService:
    """The three routes, over one `ResponsesService` (also `app.state.responses`)."""
    service = app.state.responses = ResponsesService(state)

    @app.post(RESPONSES_ROUTE, response_model=ResponseObject, responses=err_responses)
    async def create_response(body: ResponsesRequest, request: Request):
        return await service.create(request, body)

    @app.get(RESPONSES_ROUTE + "/{response_id}", response_model=ResponseObject, responses=err_responses)
    async def get_response(response_id: str):
        state.check_ready()
        return JSONResponse(service.lookup(response_id).response)

    @app.delete(RESPONSES_ROUTE + "/{response_id}", response_model=DeletedResponse, responses=err_responses)
    async def delete_response(response_id: str):
        state.check_ready()
        service.lookup(response_id)
        service.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return service
