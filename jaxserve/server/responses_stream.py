"""A response's output items, built as its text grows, and the SSE event sequence of `stream: true`.

`OutputItems` reads one chat `Choice` (the same parsers as /v1/chat/completions: `ReasoningStream`
splits off reasoning, `ToolCallStream` reads function calls) after every engine delta and turns what
is new into Responses output items and their events. Items get their `output_index` in the order they
first appear: a reasoning item while the model thinks (closed as soon as the answer or a call starts),
then a message with one `output_text` part, then one `function_call` item per call; the message and
the calls close when the output ends (text may still follow a call). A response with no item at all
gets an empty message. The non-streamed route runs the same object once over the whole output and
drops the events, so a stream's final response has the same items as the non-streamed one.

`stream_events` is the stream: `response.created`, `response.in_progress`, each item's
`output_item.added` ... `output_item.done` (with `content_part.added` / `.done` around a message's or
reasoning's text, `output_text.delta` / `.done`, `reasoning_text.delta` / `.done`,
`function_call_arguments.delta` / `.done`), then `response.completed`, or `response.incomplete` when
max_output_tokens cut the output, or `response.failed` when the engine failed. Every event has a
`sequence_number` (0, 1, 2, ... per response) and, where it applies, `output_index`, `content_index`
(always 0: one part per item) and `item_id`. Each is sent as an SSE `event:` line with its type and a
`data:` line with the JSON, and no `[DONE]` (as OpenAI sends them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from jaxserve.server.errors import dumps, engine_error

if TYPE_CHECKING:
    from jaxserve.server.streaming import Choice, Fanout, ResponseAssembler


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclasses.dataclass
class _Item:
    kind: str  # "reasoning" | "message" | "function_call"
    index: int  # its output_index
    id: str
    text: str = ""  # the reasoning, the message's text, or the call's arguments so far
    name: str | None = None  # function_call
    call_id: str | None = None  # function_call
    status: str = "in_progress"

    def as_dict(self) -> dict[str, Any]:
        if self.kind == "message":
            content = [] if self.status == "in_progress" else [_text_part(self.text)]
            return {"id": self.id, "type": "message", "role": "assistant", "status": self.status, "content": content}
        if self.kind == "reasoning":
            content = [] if self.status == "in_progress" else [{"type": "reasoning_text", "text": self.text}]
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": self.status}
        return {
            "id": self.id,
            "type": "function_call",
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.text,
            "status": self.status,
        }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputItems:
    """One choice's output items; `advance` after each delta returns the new events (dicts without
    `sequence_number`), `finish` those that close the output."""

    def __init__(self, choice: Choice, new_id: Callable[[str], str] = new_item_id):
        self.choice = choice
        self.new_id = new_id
        self.items: list[_Item] = []
        self.reasoning: _Item | None = None
        self.message: _Item | None = None
        self.calls: dict[int, _Item] = {}  # by the tool-call stream's index

    # ---- what is new in the output -------------------------------------------------------------------
    def _pieces(self, delta: str, final: bool) -> list[tuple]:
        """("reasoning", text), ("content", text), ("call", index, call id, name), ("arguments", index, text)."""
        c = self.choice
        if c.reasoning is None and c.tools is None:
            return [("content", delta)] if delta else []
        pieces: list[tuple] = []
        text = c.text
        if c.reasoning is not None:
            new_reasoning, new_content = c.reasoning.update(c.text, final=final)
            if new_reasoning:
                pieces.append(("reasoning", new_reasoning))
            text = c.reasoning.split(c.text, final=final)[1]
            if c.tools is None and new_content:
                pieces.append(("content", new_content))
        if c.tools is not None:
            for d in c.tools.update(text, final=final):
                if d.get("content"):
                    pieces.append(("content", d["content"]))
                for call in d.get("tool_calls", ()):
                    if "id" in call:
                        pieces.append(("call", call["index"], call["id"], call["function"]["name"]))
                    if call["function"].get("arguments"):
                        pieces.append(("arguments", call["index"], call["function"]["arguments"]))
        return pieces

    def advance(self, delta: str, final: bool = False) -> list[dict]:
        """The events of what `delta` (the choice's new text, already in `choice.text`) adds."""
        events: list[dict] = []
        for piece in self._pieces(delta, final):
            kind = piece[0]
            if kind == "reasoning":
                if self.reasoning is None:
                    self.reasoning = self._open("reasoning", events)
                self.reasoning.text += piece[1]
                events.append(
                    self._at(self.reasoning, "response.reasoning_text.delta", content_index=0, delta=piece[1])
                )
                continue
            self._close_reasoning(events)
            if kind == "content":
                if self.message is None:
                    self.message = self._open("message", events)
                self.message.text += piece[1]
                events.append(
                    self._at(self.message, "response.output_text.delta", content_index=0, delta=piece[1], logprobs=[])
                )
            elif kind == "call":
                self.calls[piece[1]] = self._open("function_call", events, call_id=piece[2], name=piece[3])
            else:
                item = self.calls[piece[1]]
                item.text += piece[2]
                events.append(self._at(item, "response.function_call_arguments.delta", delta=piece[2]))
        return events

    def finish(self, status: str) -> list[dict]:
        """Close every open item with `status` ("completed", or "incomplete" when the output was cut);
        an output without items gets an empty message."""
        events: list[dict] = []
        if not self.items:
            self.message = self._open("message", events)
        self._close_reasoning(events, status)
        for item in self.items:
            if item.status == "in_progress":
                self._close(item, status, events)
        return events

    def output(self) -> list[dict[str, Any]]:
        return [item.as_dict() for item in self.items]

    # ---- counting ----------------------------------------------------------------------------------
    @property
    def reasoning_text(self) -> str:
        return self.reasoning.text if self.reasoning is not None else ""

    # ---- the events of one item --------------------------------------------------------------------
    @staticmethod
    def _at(item: _Item, kind: str, **fields: Any) -> dict:
        return {"type": kind, "item_id": item.id, "output_index": item.index, **fields}

    def _open(self, kind: str, events: list[dict], **fields: Any) -> _Item:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(kind, len(self.items), self.new_id(prefix), **fields)
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": item.index, "item": item.as_dict()})
        if kind == "message":
            events.append(self._at(item, "response.content_part.added", content_index=0, part=_text_part("")))
        elif kind == "reasoning":
            events.append(
                self._at(
                    item, "response.content_part.added", content_index=0, part={"type": "reasoning_text", "text": ""}
                )
            )
        return item

    def _close_reasoning(self, events: list[dict], status: str = "completed") -> None:
        if self.reasoning is not None and self.reasoning.status == "in_progress":
            self._close(self.reasoning, status, events)

    def _close(self, item: _Item, status: str, events: list[dict]) -> None:
        item.status = status
        if item.kind == "message":
            events.append(self._at(item, "response.output_text.done", content_index=0, text=item.text, logprobs=[]))
            events.append(self._at(item, "response.content_part.done", content_index=0, part=_text_part(item.text)))
        elif item.kind == "reasoning":
            events.append(self._at(item, "response.reasoning_text.done", content_index=0, text=item.text))
            events.append(
                self._at(
                    item,
                    "response.content_part.done",
                    content_index=0,
                    part={"type": "reasoning_text", "text": item.text},
                )
            )
        else:
            events.append(self._at(item, "response.function_call_arguments.done", arguments=item.text))
        events.append({"type": "response.output_item.done", "output_index": item.index, "item": item.as_dict()})


def item_status(finish_reason: str | None) -> str:
    """The status of the items still open when the output ends."""
    return "incomplete" if finish_reason == "length" else "completed"


class Sequencer:
    """Numbers a response's events and writes each as an SSE event."""

    def __init__(self):
        self.next = 0

    def sse(self, event: dict) -> str:
        event = {**event, "sequence_number": self.next}
        self.next += 1
        return f"event: {event['type']}\ndata: {dumps(event)}\n\n"


async def stream_events(
    fan: Fanout,
    assembler: ResponseAssembler,
    items: OutputItems,
    response: Callable[[str], dict],
    finished: Callable[[dict], None],
) -> AsyncIterator[str]:
    """The SSE stream of one response. `response(status)` builds the response object as it stands
    (`in_progress` at the start, the final status at the end); `finished(obj)` takes the final one
    (to store it)."""
    seq = Sequencer()
    try:
        yield seq.sse({"type": "response.created", "response": response("in_progress")})
        yield seq.sse({"type": "response.in_progress", "response": response("in_progress")})
        reason = None
        async for i, out in fan.events():
            # the assembler's bookkeeping (the totals, the server's metrics), as for a chat completion
            for choice, delta, _ids, _lps, just_finished in assembler._observe(i, out):
                for event in items.advance(delta, final=just_finished):
                    yield seq.sse(event)
                if just_finished:
                    reason = choice.finish_reason
                    for event in items.finish(item_status(reason)):
                        yield seq.sse(event)
        final = response(response_status(reason))
        finished(final)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield seq.sse({"type": kind, "response": final})
    except asyncio.CancelledError:
        raise
    except BaseException as err:  # noqa: BLE001 - headers are sent: report in-band
        api = engine_error(err)
        failed = response("failed")
        failed["error"] = {"code": "server_error" if api.status >= 500 else "invalid_prompt", "message": api.message}
        yield seq.sse({"type": "response.failed", "response": failed})
    finally:
        fan.close()


def response_status(finish_reason: str | None) -> str:
    """A response's status from its one choice's finish reason."""
    if finish_reason == "length":
        return "incomplete"
    if finish_reason == "abort":
        return "cancelled"
    return "completed"
