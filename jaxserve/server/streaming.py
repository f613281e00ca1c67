"""Stream assembly: a translated request through the engine and back as one response or an SSE stream.

`respond` submits one engine request per prompt (each yields its `n` choices), all delivering their
deltas (new text, token ids, logprob entries) into one queue (`Fanout`). The engine's
`OutputAccumulator` sums them, as it does for `LLM.generate`; `Choice` reads one sample's total, and
`ResponseAssembler` builds the OpenAI objects: the final response with usage, or the chunks of a
stream. A client that disconnects gets its engine requests aborted (HTTP 499 when nothing was sent
yet); a failure after the first chunk ends the stream with an in-band error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxserve.engine.output_processor import OutputAccumulator
from jaxserve.engine.processor import EngineRequest
from jaxserve.sampling.params import CompletionOutput, RequestOutput
from jaxserve.server.errors import APIError, dumps, engine_error, error_body
from jaxserve.server.logprobs import LogprobFormatter
from jaxserve.server.requests import GenerationRequest
from jaxserve.server.reasoning_parsers import ReasoningStream
from jaxserve.server.tool_parsers import ToolCallStream, get_parser

if TYPE_CHECKING:
    from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest
    from jaxserve.server.state import ServerState

logger = logging.getLogger(__name__)


class _ClientGone(Exception):
    pass


@dataclasses.dataclass
class Submission:
    """One prompt's checked engine request; its `width` (= n) outputs are choices base_choice, base_choice + 1, ..."""

    request: EngineRequest
    prompt_index: int
    base_choice: int
    arrival: float = 0.0
    width: int = 1
    first_time: float | None = None
    done: bool = False

    request_id = property(lambda self: self.request.request_id)
    prompt_ids = property(lambda self: self.request.prompt_token_ids)
    prompt_text = property(lambda self: self.request.prompt)


async def start_fanout(state: ServerState, request: Request, subs: list[Submission]) -> Fanout | None:
    """Submit every prompt (`Fanout.prime`), racing the client's disconnect: the Fanout once the engine
    accepted them all; None if the client went away first (the caller answers 499). An engine's
    refusal is raised as its HTTP error."""
    fan = Fanout(state, subs)
    try:
        await race_disconnect(fan.prime(), request)
    except _ClientGone:
        fan.close()
        return None
    except BaseException as err:
        fan.close()
        if isinstance(err, asyncio.CancelledError):
            raise
        raise engine_error(err) from None
    return fan


async def respond(
    state: ServerState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    job: GenerationRequest,
    rid: str,
    model: str,
    arrival: float,
) -> Response:
    """Submit `job`'s prompts; once the engine has accepted every one (else its 400), answer or stream."""
    n = job.params.n
    subs = [Submission(request, p, p * n, arrival=arrival, width=n) for p, request in enumerate(job.requests)]
    fan = await start_fanout(state, request, subs)
    if fan is None:
        return Response(status_code=499)

    # After the engine accepted the prompts: echoing decodes their token ids, which it has checked.
    tok = state.tokenizer
    choices: dict[int, Choice] = {}
    try:
        for sub in subs:
            echo_text = ""
            if job.echo:
                echo_text = (
                    sub.prompt_text
                    if sub.prompt_text is not None
                    else (tok.decode(sub.prompt_ids, skip_special_tokens=False) if tok is not None else "")
                )
            for k in range(sub.width):
                choice = Choice(sub.base_choice + k, sub, echo_text, job.drop_generated)
                if job.tools is not None and job.tools.parser is not None:
                    choice.tools = ToolCallStream(get_parser(job.tools.parser), parallel=job.tools.parallel)
                if job.reasoning is not None:
                    choice.reasoning = ReasoningStream(job.reasoning, job.reasoning_open)
                choices[sub.base_choice + k] = choice
    except BaseException:
        fan.close()  # the engine's requests are running: abort them rather than leave them orphaned
        raise

    out = ResponseAssembler(state, rid, model, job, subs, choices, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(
            out.stream(fan, include_usage),
            on_close=fan.close,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        await race_disconnect(out.collect(fan), request)
    except _ClientGone:
        return Response(status_code=499)
    except APIError:
        raise
    except asyncio.CancelledError:
        raise
    except BaseException as err:  # noqa: BLE001
        raise engine_error(err) from None
    finally:
        fan.close()
    return JSONResponse(out.response())


# ---- the engine side: one generator per engine request, pumped into one queue ----------------------


class Fanout:
    """The engine requests of one HTTP request, all delivering into one queue: yields (engine request
    index, delta) until each has finished or failed."""

    def __init__(self, state: ServerState, subs: list[Submission]):
        self.state = state
        self.subs = subs
        self.queue: asyncio.Queue = asyncio.Queue()  # (sub index, delta | exception), from the engine
        self.buffer: list[tuple[int, Any]] = []
        self.open = len(subs)
        self.awaiting_first = set(range(len(subs)))  # counted in state.pending_first until they answer
        state.pending_first += len(subs)

    def _answered(self, i: int) -> None:
        if i in self.awaiting_first:
            self.awaiting_first.discard(i)
            self.state.pending_first -= 1

    async def prime(self) -> None:
        """Submit every engine request, then wait until each has answered once; raise the error of one
        the engine refused (its checks raise at submit; a refusal at admission arrives as an error)."""
        engine = self.state.engine
        for i, sub in enumerate(self.subs):
            try:
                await engine.submit(sub.request, self.queue, tag=i)
            except Exception:
                sub.done = True  # refused (a 400): not counted as an abort when the request closes
                raise
        seen: set[int] = set()
        while len(seen) < len(self.subs):
            item = await self.queue.get()
            self.buffer.append(item)
            seen.add(item[0])
            self._answered(item[0])
            if isinstance(item[1], BaseException):
                self.subs[item[0]].done = True  # refused: not counted as an abort when the request closes
                raise item[1]

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self.open:
            i, item = self.buffer.pop(0) if self.buffer else await self.queue.get()
            answered_before = i not in self.awaiting_first
            self._answered(i)
            sub = self.subs[i]
            if isinstance(item, BaseException):
                if not sub.done and answered_before:
                    self.state.metrics.finished.labels(finish_reason="error").inc(sub.width)
                sub.done = True
                self.open -= 1
                raise item
            if item.finished:
                self.open -= 1
            yield i, item

    def close(self) -> None:
        """Abort the engine requests still running (the engine ignores ids it never admitted); count
        them as finish_reason 'abort'."""
        for i in list(self.awaiting_first):
            self._answered(i)
        for sub in self.subs:
            if not sub.done:
                sub.done = True
                self.state.engine.abort(sub.request_id)
                self.state.metrics.finished.labels(finish_reason="abort").inc(sub.width)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(coro, request: Request):
    """Await `coro`, unless the client disconnects first (then raise _ClientGone)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise _ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class SSEResponse(StreamingResponse):
    """A stream that releases its engine requests however it ends, even if the body never started
    (a client that left before the first byte)."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# ---- the client side: choices and the OpenAI objects -----------------------------------------------


class Choice:
    """One choice of the response: one sample of one engine request. Its output so far is that sample's
    total in the assembler's `OutputAccumulator`, where the deltas are summed; with `drop` (echo with
    max_tokens 0) the generated tokens are counted but not returned."""

    def __init__(self, index: int, sub: Submission, echo_text: str, drop_generated: bool):
        self.index = index
        self.sub = sub
        self.echo_text = echo_text
        self.echo_sent = not echo_text
        self.drop = drop_generated
        self.output = CompletionOutput(index - sub.base_choice, [], "", None)  # the total, once a delta came
        self.prompt_lps_sent = False
        self.offset = len(echo_text)
        self.tools: ToolCallStream | None = None  # chat with tools: the output is parsed into tool calls
        self.reasoning: ReasoningStream | None = None  # --reasoning-parser: reasoning apart from content

    @property
    def token_ids(self) -> list[int]:
        return [] if self.drop else self.output.token_ids

    @property
    def text(self) -> str:
        return "" if self.drop else self.output.text

    @property
    def all_logprobs(self) -> list:
        return [] if self.drop else (self.output.logprobs or [])

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason

    def update(self, o: CompletionOutput, total: CompletionOutput) -> tuple[str, list[int], list, bool]:
        """Take a delta `o` of this sample, already summed into `total`; return (new text, new ids, new
        logprob entries, just finished). Both engines report a sample's finish reason in one delta."""
        self.output = total
        if self.drop:
            return "", [], [], o.finish_reason is not None
        return o.text, list(o.token_ids), list(o.logprobs or []), o.finish_reason is not None


class ResponseAssembler:
    """The OpenAI objects of one request (completion or chat), and the server metrics of its engine requests."""

    def __init__(
        self,
        state: ServerState,
        rid: str,
        model: str,
        job: GenerationRequest,
        subs: list[Submission],
        choices: dict[int, Choice],
        body: CompletionRequest | ChatCompletionRequest,
    ):
        self.state, self.rid, self.model, self.chat = state, rid, model, job.chat
        self.subs, self.choices, self.n_logprobs, self.echo = subs, choices, job.n_logprobs, job.echo
        self.want_prompt_logprobs = body.prompt_logprobs is not None
        self.fmt = LogprobFormatter(state.tokenizer)
        self.created = int(time.time())
        self.totals = OutputAccumulator()  # each engine request's output so far, by request id
        self.weight_version: Any = None  # of the weights that made the last output (SGLang's metadata)
        self.kv_transfer_params: Any = None  # a KV connector's, on the final output (vLLM's P/D proxy reads it)

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _observe(self, i: int, out: RequestOutput) -> list[tuple[Choice, str, list[int], list, bool]]:
        sub = self.subs[i]
        now = time.monotonic()
        updates = []
        if out.outputs and any(o.token_ids for o in out.outputs) and sub.first_time is None:
            sub.first_time = now
            self.state.metrics.ttft.observe(now - sub.arrival)
            m = out.metrics
            if m is not None and m.first_scheduled_time and m.arrival_time:
                self.state.metrics.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        total = {t.index: t for t in self.totals.add(out).outputs}
        if out.weight_version is not None:
            self.weight_version = out.weight_version
        if getattr(out, "kv_transfer_params", None) is not None:
            self.kv_transfer_params = out.kv_transfer_params
        for o in out.outputs:
            choice = self.choices.get(sub.base_choice + o.index)
            if choice is None:
                continue
            updates.append((choice, *choice.update(o, total[o.index])))
        if out.finished and not sub.done:
            sub.done = True
            self.state.metrics.e2e.observe(now - sub.arrival)
            mine = [c for c in self.choices.values() if c.sub is sub]
            longest = max((len(c.output.token_ids) for c in mine), default=0)  # also tokens not returned
            if sub.first_time is not None and longest > 1:
                self.state.metrics.tpot.observe((now - sub.first_time) / (longest - 1))
            for c in mine:
                self.state.metrics.finished.labels(finish_reason=str(c.finish_reason)).inc()
        return updates

    def usage(self) -> dict:
        prompt = sum(len(sub.prompt_ids) for sub in self.subs)  # one engine request per prompt
        completion = sum(len(c.token_ids) for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _echo_logprobs(self, choice: Choice) -> tuple[list[int], list]:
        total = self.totals.outputs.get(choice.sub.request_id)
        entries = None if total is None else total.prompt_logprobs
        ids = choice.sub.prompt_ids
        if entries is None:
            entries = [None] * len(ids)
        return ids, entries

    def _prompt_logprobs(self, choice: Choice) -> list:
        ids, entries = self._echo_logprobs(choice)
        return self.fmt.prompt_logprobs(entries, ids)

    # ---- non-streaming ---------------------------------------------------------------------------
    async def collect(self, fan: Fanout) -> None:
        async for i, out in fan.events():
            self._observe(i, out)

    def response(self) -> dict:
        choices = []
        for idx in sorted(self.choices):
            c = self.choices[idx]
            lps = None
            if self.n_logprobs is not None:
                ids, entries = list(c.token_ids), list(c.all_logprobs)
                if self.chat:
                    lps = {"content": self.fmt.chat_logprobs(ids, entries, self.n_logprobs)}
                else:
                    if self.echo:
                        echo_ids, echo_entries = self._echo_logprobs(c)
                        ids, entries = echo_ids + ids, echo_entries + entries
                    lps, _ = self.fmt.completion_logprobs(ids, entries, self.n_logprobs, 0)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                reason = c.finish_reason
                text = c.text
                if c.reasoning is not None:  # the reasoning apart; tools and the content read what follows it
                    reasoning, text = c.reasoning.split(c.text, final=True)
                    message["reasoning_content"] = reasoning or None
                    message["content"] = text or None
                if c.tools is not None:
                    content, calls = c.tools.result(text)
                    message["content"] = content if (content is not None or calls or c.reasoning) else ""
                    if calls:
                        message["tool_calls"] = calls
                        reason = "tool_calls" if reason == "stop" else reason
                choice = {"index": idx, "message": message, "logprobs": lps, "finish_reason": reason}
            else:
                choice = {"index": idx, "text": c.echo_text + c.text, "logprobs": lps, "finish_reason": c.finish_reason}
            if self.want_prompt_logprobs:
                choice["prompt_logprobs"] = self._prompt_logprobs(c)
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            # SGLang's: which weights answered (update_weights' weight_version; absent from the mock engine)
            **({"metadata": {"weight_version": self.weight_version}} if self.weight_version is not None else {}),
            **({"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params is not None else {}),
        }

    # ---- streaming -------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage: Any = None, include_usage: bool = False) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.weight_version is not None:  # SGLang's metadata, as on the whole response: from the first output on
            chunk["metadata"] = {"weight_version": self.weight_version}
        if include_usage:
            chunk["usage"] = usage
        return f"data: {dumps(chunk)}\n\n"

    async def stream(self, fan: Fanout, include_usage: bool) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield self._chunk(
                    [
                        {
                            "index": idx,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for idx in sorted(self.choices)
                    ],
                    None,
                    include_usage,
                )
            async for i, out in fan.events():
                per_choice = []  # a choice's pieces go in successive chunks (a tool call's header, then its arguments)
                for choice, delta, new_ids, new_lps, just_finished in self._observe(i, out):
                    if choice.tools is not None or choice.reasoning is not None:
                        per_choice.append(self._parsed_pieces(choice, new_ids, new_lps, just_finished))
                    else:
                        piece = self._stream_piece(choice, delta, new_ids, new_lps, just_finished)
                        per_choice.append([piece] if piece is not None else [])
                for k in range(max((len(p) for p in per_choice), default=0)):
                    yield self._chunk([p[k] for p in per_choice if len(p) > k], None, include_usage)
            if include_usage:
                yield self._chunk([], self.usage(), True)
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - headers are sent: report in-band, then end the stream
            api = engine_error(err)
            yield f"data: {dumps(error_body(api.status, api.message, type=api.type, code=api.code))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            fan.close()

    def _parsed_pieces(self, c: Choice, new_ids: list[int], new_lps: list, finished: bool) -> list[dict]:
        """A chat choice with tools or a reasoning parser: its reasoning, content and tool-call deltas
        since the last chunk, one piece each."""
        deltas: list[dict] = []
        text = c.text
        if c.reasoning is not None:
            new_reasoning, new_content = c.reasoning.update(c.text, final=finished)
            if new_reasoning:
                deltas.append({"reasoning_content": new_reasoning})
            text = c.reasoning.split(c.text, final=finished)[1]
            if c.tools is None and new_content:
                deltas.append({"content": new_content})
        if c.tools is not None:
            deltas += c.tools.update(text, final=finished)
        lps = None
        if self.n_logprobs is not None and new_ids:
            lps = {"content": self.fmt.chat_logprobs(new_ids, new_lps, self.n_logprobs)}
        if finished or (lps is not None and not deltas):
            deltas.append({})
        pieces = [{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if pieces:
            pieces[0]["logprobs"] = lps
        if finished:
            reason = c.finish_reason
            pieces[-1]["finish_reason"] = "tool_calls" if (reason == "stop" and c.tools and c.tools.called) else reason
        return pieces

    def _stream_piece(self, c: Choice, delta: str, new_ids: list[int], new_lps: list, finished: bool) -> dict | None:
        echo_part = ""
        echo_ids: list[int] = []
        echo_entries: list = []
        if not c.echo_sent:
            c.echo_sent = True
            echo_part = c.echo_text
            if self.n_logprobs is not None:
                echo_ids, echo_entries = self._echo_logprobs(c)
        if not (delta or new_ids or finished or echo_part):
            return None
        lps = None
        if self.n_logprobs is not None:
            if self.chat:
                lps = {"content": self.fmt.chat_logprobs(new_ids, new_lps, self.n_logprobs)}
            else:
                offset = 0 if echo_part else c.offset
                lps, end = self.fmt.completion_logprobs(
                    echo_ids + new_ids, echo_entries + new_lps, self.n_logprobs, offset
                )
                c.offset = end
        reason = c.finish_reason if finished else None
        if self.chat:
            d = {"content": delta} if (delta or not finished) else {}
            piece = {"index": c.index, "delta": d, "logprobs": lps, "finish_reason": reason}
        else:
            piece = {"index": c.index, "text": echo_part + delta, "logprobs": lps, "finish_reason": reason}
        if self.want_prompt_logprobs and not c.prompt_lps_sent:
            c.prompt_lps_sent = True
            piece["prompt_logprobs"] = self._prompt_logprobs(c)
        return piece
