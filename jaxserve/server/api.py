"""The OpenAI-compatible FastAPI app over an `AsyncLLMEngine` (or the mock engine).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/capabilities,
GET /health (200 only once the engine is warm and while not draining), GET /metrics (Prometheus).

Errors are OpenAI-style objects, `{"error": {"message", "type", "param", "code"}}`:
  400  body not JSON; a parameter jaxserve does not support (named); a parameter the engine build
       does not support yet (named); a request the engine rejects (prompt too long, bad token ids, ...)
  401  /v1/* without `Authorization: Bearer <--api-key>` (when an API key is set)
  404  unknown model name; unknown route
  413  body over --max-body-bytes
  422  a field of the wrong type or out of its documented range, a missing required field
  503  engine not warm yet, server draining, or more than --max-waiting requests already waiting
  500  an unexpected failure while processing this one request (the server keeps serving)
A streamed request that fails after its first chunk ends with an SSE `data: {"error": ...}` event
followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.errors import JaxServeError, RequestError
from jaxserve.generation_config import BUILT_IN, GenerationDefaults, load_generation_defaults
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.chat import ChatRenderer, ChatTemplateError
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.protocol import (
    KNOWN_UNSUPPORTED,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
COMPLETION_DEFAULT_MAX_TOKENS = 16

# Request-side name -> (SamplingParams field, value meaning "not asked for"). A field the engine's
# SamplingParams lacks is refused by name unless the request leaves it at this value.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "stop": (),
    "min_tokens": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logprobs": None,
    "prompt_logprobs": None,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "stop_token_ids": (),
    "ignore_eos": False,
    "seed": None,
    "top_k": 0,
    "top_p": 1.0,
    "temperature": 1.0,
}


@dataclasses.dataclass
class ServerOptions:
    served_model_names: Sequence[str] = ("jaxserve",)
    model_path: str | None = None  # also accepted as a model name
    api_key: str | None = None
    max_waiting: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    device_bandwidth: float | None = None
    weights_note: str | None = None  # e.g. "dummy weights", shown by /v1/models and /v1/capabilities
    # Built and checked at start-up (serve.py), before the engine compiles; None: built from the engine.
    chat_renderer: ChatRenderer | None = None
    generation_defaults: GenerationDefaults | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


class _ClientGone(Exception):
    pass


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 422: "invalid_request_error", 405: "invalid_request_error",
                503: "service_unavailable", 500: "internal_error"}


def error_body(status: int, message: str, type: str | None = None, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type or _ERROR_TYPES.get(status, "error"), "param": param,
                      "code": code if code is not None else status}}


def error_response(status: int, message: str, **kw: Any) -> JSONResponse:
    return JSONResponse(error_body(status, message, **kw), status_code=status)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# ==============================================================================================
# Server state: the engine (once warm), the tokenizer, the chat renderer, counters.
# ==============================================================================================


class ServerState:
    def __init__(self, options: ServerOptions):
        self.options = options
        self.engine: Any = None
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.owns_engine = False  # shut the engine down with the app (serve.py), or leave it to the caller
        self.pending_first = 0  # engine requests submitted whose first output has not arrived
        self.metrics = ServerMetrics(self._stats, options.device_bandwidth)
        self.chat: ChatRenderer | None = options.chat_renderer
        self.generation_defaults: GenerationDefaults = options.generation_defaults or BUILT_IN
        self.created = int(time.time())

    # ---- engine -------------------------------------------------------------------------------
    def set_engine(self, engine: Any, owned: bool = True) -> None:
        """Attach a started, warm engine; from now on /health is 200. An owned engine is shut down with the app."""
        self.engine = engine
        self.owns_engine = owned
        if self.options.chat_renderer is None:
            try:
                self.chat = ChatRenderer(self.tokenizer)
            except ChatTemplateError as err:
                logger.warning("%s; chat requests will use the ChatML fallback", err)
                self.chat = ChatRenderer(None)
        if self.options.generation_defaults is None:
            settings = getattr(getattr(engine, "engine", None), "settings", None)
            self.generation_defaults = load_generation_defaults(settings) if settings is not None else BUILT_IN
        self.ready = True

    def _stats(self) -> dict | None:
        if self.engine is None:
            return None
        try:
            return self.engine.stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because stats did
            logger.exception("engine.stats() failed")
            return None

    @property
    def tokenizer(self) -> Any:
        return getattr(getattr(self.engine, "engine", None), "tokenizer", None)

    @property
    def max_model_len(self) -> int | None:
        plan = getattr(getattr(self.engine, "engine", None), "plan", None)
        return getattr(plan, "max_model_len", None)

    @property
    def sampling_params_cls(self) -> type:
        return getattr(self.engine, "sampling_params_cls", SamplingParams)

    @property
    def engine_fields(self) -> set[str]:
        return {f.name for f in dataclasses.fields(self.sampling_params_cls)}

    def model_name(self) -> str:
        return self.options.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        names = list(self.options.served_model_names)
        if name is None or name in names or (self.options.model_path and name == self.options.model_path):
            return names[0] if name is None else name
        raise APIError(404, f"the model {name!r} does not exist; this server serves {', '.join(map(repr, names))}",
                       type="not_found_error", param="model", code="model_not_found")

    def check_ready(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="draining")
        if not self.ready:
            message = "the model is still loading; retry when GET /health returns 200"
            if self.load_error:
                message = f"the model failed to load: {self.load_error}"
            raise APIError(503, message, type="service_unavailable", code="not_ready")

    async def check_queue(self) -> None:
        bound = self.options.max_waiting
        if bound is None:
            return
        # stats() may wait for the engine's step lock: keep the event loop free meanwhile
        stats = await asyncio.to_thread(self._stats) or {}
        waiting = max(int(stats.get("num_waiting", 0) or 0), self.pending_first)
        if waiting >= bound:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise APIError(503, f"the server is overloaded: {waiting} requests are waiting (--max-waiting {bound}); "
                                "retry later", type="service_unavailable", code="queue_full")


# ==============================================================================================
# Gate middleware: API key (401), body size (413), status counters.
# ==============================================================================================

_KNOWN_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/capabilities", "/health", "/metrics"}


class GateMiddleware:
    def __init__(self, app: Callable, state: ServerState):
        self.app = app
        self.state = state

    async def _send_error(self, send, status: int, message: str, **kw: Any) -> None:
        body = _dumps(error_body(status, message, **kw)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in _KNOWN_ROUTES else "other"
        status_seen = []

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        try:
            await self._handle(scope, receive, counting_send, path)
        finally:
            if status_seen:
                self.state.metrics.requests.labels(route=route, status=str(status_seen[0])).inc()

    async def _handle(self, scope, receive, send, path):
        key = self.state.options.api_key
        if key and path.startswith("/v1"):
            auth = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
                return await self._send_error(
                    send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.state.options.max_body_bytes
        length = dict(scope.get("headers") or ()).get(b"content-length")
        too_big = f"request body over the limit of {limit} bytes (--max-body-bytes)"
        if length is not None:
            try:
                if int(length) > limit:
                    self.state.metrics.rejected.labels(reason="body_too_large").inc()
                    return await self._send_error(send, 413, too_big, code="request_too_large")
            except ValueError:
                return await self._send_error(send, 400, "invalid Content-Length header")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                self.state.metrics.rejected.labels(reason="body_too_large").inc()
                return await self._send_error(send, 413, too_big, code="request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


# ==============================================================================================
# One request's engine work: a generator per (prompt, sibling group), pumped into one queue.
# ==============================================================================================

_END = object()


@dataclasses.dataclass
class _Sub:
    """One engine request."""

    request_id: str
    prompt_index: int
    base_choice: int  # choice index of the engine's output 0
    prompt_ids: list[int]
    prompt_text: str | None
    params: Any
    arrival: float = 0.0
    width: int = 1  # completions this engine request produces (its n)
    first_time: float | None = None
    done: bool = False


class _Fanout:
    """Runs the engine generators of one HTTP request concurrently and yields (sub index, output)."""

    def __init__(self, state: ServerState, subs: list[_Sub]):
        self.state = state
        self.subs = subs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.buffer: list[tuple[int, Any, Any]] = []
        self.open = len(subs)
        state.pending_first += len(subs)
        self.tasks = [asyncio.ensure_future(self._pump(i, sub)) for i, sub in enumerate(subs)]

    async def _pump(self, i: int, sub: _Sub) -> None:
        first = True
        gen = self.state.engine.generate(sub.request_id, prompt=None, sampling_params=sub.params,
                                         prompt_token_ids=list(sub.prompt_ids))
        try:
            async for out in gen:
                if first:
                    first = False
                    self.state.pending_first -= 1
                self.queue.put_nowait((i, out, None))
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - handed to the request, which answers 400/500
            if not sub.done and not first:
                self.state.metrics.finished.labels(finish_reason="error").inc(sub.width)
            sub.done = True
            self.queue.put_nowait((i, None, err))
        finally:
            if first:
                self.state.pending_first -= 1
            try:
                await gen.aclose()
            except BaseException:  # noqa: BLE001
                pass
            self.queue.put_nowait((i, None, _END))

    async def prime(self) -> None:
        """Wait until every engine request has answered once; raise its error if one failed."""
        seen: set[int] = set()
        while len(seen) < len(self.subs):
            item = await self.queue.get()
            self.buffer.append(item)
            seen.add(item[0])
            if item[2] is not None and item[2] is not _END:
                raise item[2]

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        while self.open:
            item = self.buffer.pop(0) if self.buffer else await self.queue.get()
            i, out, err = item
            if err is _END:
                self.open -= 1
                continue
            if err is not None:
                raise err
            yield i, out

    def close(self) -> None:
        """Cancel what still runs (its engine requests are aborted); count those as finish_reason 'abort'."""
        for task in self.tasks:
            if not task.done():
                task.cancel()
        for sub in self.subs:
            if not sub.done:
                sub.done = True
                self.state.metrics.finished.labels(finish_reason="abort").inc(sub.width)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _race_disconnect(coro, request: Request):
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


def _engine_error(err: BaseException) -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, RequestError):
        return APIError(400, str(err), code="invalid_request")
    if isinstance(err, JaxServeError):
        return APIError(503, f"the engine cannot take this request: {err}", type="service_unavailable",
                        code="engine_unavailable")
    logger.error("request failed inside the engine", exc_info=(type(err), err, err.__traceback__))
    return APIError(500, f"internal error while processing this request: {type(err).__name__}: {err}",
                    type="internal_error", code="internal_error")


# ==============================================================================================
# Output assembly
# ==============================================================================================


class _Choice:
    def __init__(self, index: int, sub: _Sub, echo_text: str, drop_generated: bool):
        self.index = index
        self.sub = sub
        self.echo_text = echo_text
        self.echo_sent = not echo_text
        self.drop = drop_generated
        self.text_sent = 0
        self.tokens_sent = 0
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.all_logprobs: list = []
        self.prompt_lps_sent = False
        self.offset = len(echo_text)

    def update(self, o: Any) -> tuple[str, list[int], list, bool]:
        """Take a cumulative CompletionOutput; return (new text, new ids, new logprob entries, just finished)."""
        ids = [] if self.drop else list(o.token_ids)
        text = "" if self.drop else (o.text or "")
        new_ids = ids[self.tokens_sent:]
        lps = getattr(o, "logprobs", None)
        new_lps = [] if (self.drop or lps is None) else list(lps[self.tokens_sent: len(ids)])
        if new_lps:
            self.all_logprobs.extend(new_lps)
        if text.startswith(self.text[: self.text_sent]) or self.text_sent == 0:
            delta = text[self.text_sent:]
        else:  # the engine revised text it had already released; we cannot unsend it
            logger.warning("request %s: output text changed after it was streamed", self.sub.request_id)
            delta = text[self.text_sent:] if len(text) > self.text_sent else ""
        self.token_ids, self.text = ids, text
        self.tokens_sent = len(ids)
        self.text_sent = max(self.text_sent, len(text))
        just_finished = self.finish_reason is None and o.finish_reason is not None
        if o.finish_reason is not None:
            self.finish_reason = o.finish_reason
        return delta, new_ids, new_lps, just_finished


def _lp_value(v: Any) -> float:
    return float(v if isinstance(v, (int, float)) else getattr(v, "logprob"))


class _Formatter:
    """Token strings and logprob objects for one request."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        try:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        except Exception:  # noqa: BLE001
            return f"token_id:{token_id}"

    def top(self, entry: dict | None, n: int) -> list[tuple[int, float]]:
        if not entry:
            return []
        items = sorted(((int(t), _lp_value(v)) for t, v in entry.items()), key=lambda kv: -kv[1])
        return items[:n]

    def completion_logprobs(self, ids: list[int], entries: list, n: int, offset: int) -> tuple[dict, int]:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(ids, entries):
            s = self.token(tid)
            out["tokens"].append(s)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                chosen = entry.get(tid, entry.get(str(tid)))
                out["token_logprobs"].append(_lp_value(chosen) if chosen is not None else None)
                top: dict[str, float] = {}
                for t, lp in self.top(entry, n):
                    top.setdefault(self.token(t), lp)
                out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(s)
        return out, offset

    def prompt_logprobs(self, entries: list) -> list:
        """vLLM's shape: per prompt token None (the first) or {token id: {"logprob", "decoded_token"}}."""
        return [None if e is None else {str(int(t)): {"logprob": _lp_value(v), "decoded_token": self.token(int(t))}
                                        for t, v in e.items()} for e in entries]

    def chat_logprobs(self, ids: list[int], entries: list, n: int) -> list[dict]:
        content = []
        for tid, entry in zip(ids, entries):
            s = self.token(tid)
            chosen = (entry or {}).get(tid)
            content.append({
                "token": s,
                "logprob": _lp_value(chosen) if chosen is not None else -9999.0,
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": self.token(t), "logprob": lp, "bytes": list(self.token(t).encode("utf-8"))}
                    for t, lp in self.top(entry, n)
                ],
            })
        return content


# ==============================================================================================
# The app
# ==============================================================================================


def create_app(options: ServerOptions | None = None, engine: Any = None, shutdown_engine: bool = False) -> FastAPI:
    """Build the app. Pass a started, warm `engine` now, or later via `app.state.jaxserve.set_engine(engine)`.

    An engine passed here is shut down with the app only if `shutdown_engine`; one attached later with
    `set_engine(engine)` is (that is how `python -m jaxserve.serve` uses it).
    """
    options = options or ServerOptions()
    state = ServerState(options)

    async def lifespan(app: FastAPI):
        yield
        if state.engine is not None and state.owns_engine:
            state.draining = True
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="jaxserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible LLM inference server over jaxserve's JAX engine.")
    app.state.jaxserve = state
    if engine is not None:
        state.set_engine(engine, owned=shutdown_engine)
    app.add_middleware(GateMiddleware, state=state)

    # ---- error handlers --------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err.status, err.message, type=err.type, param=err.param, code=err.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        errors = err.errors()
        for e in errors:
            if e.get("type") == "json_invalid":
                detail = (e.get("ctx") or {}).get("error", "")
                return error_response(400, f"the request body is not valid JSON: {detail}".strip(), code="invalid_json")
        unsupported = [e for e in errors if e.get("type") == "unsupported_field"]
        if unsupported:
            fields = sorted({str((e.get("ctx") or {}).get("field")) for e in unsupported})
            return error_response(400, "; ".join(sorted({e["msg"] for e in unsupported})), param=fields[0],
                                  code="unsupported_parameter")
        combos = [e for e in errors if e.get("type") == "invalid_combination"]
        if combos:
            return error_response(400, combos[0]["msg"], param=(combos[0].get("ctx") or {}).get("field"),
                                  code="invalid_parameter_combination")
        parts, first_param = [], None
        for e in errors[:8]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            where = ".".join(loc) or "body"
            first_param = first_param or (loc[0] if loc else None)
            parts.append(f"{where}: {e.get('msg')}")
        return error_response(422, "invalid request: " + "; ".join(parts), param=first_param, code="validation_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(error_body(err.status_code, str(err.detail)), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        logger.exception("unhandled error in %s", request.url.path)
        return error_response(500, f"internal error: {type(err).__name__}", code="internal_error")

    # ---- simple routes ---------------------------------------------------------------------------
    err_responses = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 422, 500, 503)}

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        if state.draining:
            return error_response(503, "draining", code="draining")
        if not state.ready:
            return error_response(503, state.load_error or "loading", code="not_ready")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        # rendering reads engine.stats(), which may wait for the engine's step lock: not on the event loop
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=ModelList, responses=err_responses)
    async def models():
        cards = [
            {"id": name, "object": "model", "created": state.created, "owned_by": "jaxserve",
             "root": options.model_path, "max_model_len": state.max_model_len}
            for name in options.served_model_names
        ]
        return {"object": "list", "data": cards}

    @app.get("/v1/capabilities", responses=err_responses)
    async def capabilities():
        engine_fields = state.engine_fields if state.ready else set()
        needs_engine = sorted(k for k in SAMPLING_DEFAULTS if k not in engine_fields and k != "n")
        needs_engine = needs_engine if state.ready else []
        return {
            "object": "capabilities",
            "model": state.model_name(),
            "weights": options.weights_note,
            "ready": state.ready,
            "max_model_len": state.max_model_len,
            "tokenizer": state.tokenizer is not None,
            "chat_template": state.chat.source if state.chat else None,
            "chat_template_origin": state.chat.origin if state.chat else None,
            "generation_defaults": state.generation_defaults.as_dict(),
            "endpoints": ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                          "GET /v1/capabilities", "GET /health", "GET /metrics"],
            "completions": {"fields": sorted(CompletionRequest.model_fields)},
            "chat_completions": {"fields": sorted(ChatCompletionRequest.model_fields),
                                 "roles": ["system", "developer", "user", "assistant"], "content_parts": ["text"]},
            "response_format": ["text"],
            "stream_options": ["include_usage"],
            "limits": {"max_n": MAX_N, "max_prompts": MAX_PROMPTS, "max_logprobs": MAX_LOGPROBS,
                       "max_body_bytes": options.max_body_bytes, "max_waiting": options.max_waiting},
            "engine_sampling_params": sorted(engine_fields),
            "not_supported_by_engine_yet": needs_engine,
            "n_by": "engine" if "n" in engine_fields else "server fan-out",
            "rejected_parameters": sorted(KNOWN_UNSUPPORTED),
        }

    # ---- generation routes -----------------------------------------------------------------------
    @app.post("/v1/completions", response_model=CompletionResponse, responses=err_responses)
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(state, request, body, chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=err_responses)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(state, request, body, chat=True)

    return app


# ---- request handling ----------------------------------------------------------------------------


def _prompts_of(state: ServerState, body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    p = body.prompt
    if isinstance(p, str):
        items: list = [p]
    elif isinstance(p[0], str):
        items = list(p)
    elif isinstance(p[0], int):
        items = [list(p)]
    else:
        items = [list(x) for x in p]
    tok = state.tokenizer
    out = []
    for item in items:
        if isinstance(item, str):
            if tok is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt",
                               code="no_tokenizer")
            out.append((item, list(tok.encode(item))))
        else:
            out.append((None, [int(t) for t in item]))
    return out


def _build_params(state: ServerState, values: dict[str, Any]) -> tuple[Any, int]:
    """SamplingParams of the engine's class from request values; returns (params, server-side fan-out)."""
    cls = state.sampling_params_cls
    fields = state.engine_fields
    fanout = 1
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        if name in fields:
            kwargs[name] = value
        elif name == "n":
            fanout = value
        elif value != SAMPLING_DEFAULTS.get(name, object()):
            raise APIError(400, f"parameter {name!r} is not supported by this engine build yet", param=name,
                           code="unsupported_parameter")
    try:
        return cls(**kwargs), fanout
    except RequestError as err:
        raise APIError(400, str(err), code="invalid_sampling_params") from None
    except (TypeError, ValueError) as err:
        raise APIError(400, f"invalid sampling parameters: {err}", code="invalid_sampling_params") from None


def _common_values(body: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "n", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                 "prompt_logprobs"):
        v = getattr(body, name)
        if v is not None:
            values[name] = v
    if body.stop is not None:
        values["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if body.stop_token_ids is not None:
        values["stop_token_ids"] = tuple(body.stop_token_ids)
    return values


async def _serve(state: ServerState, request: Request, body: Any, chat: bool):
    arrival = time.monotonic()
    state.check_ready()
    model = state.check_model(body.model)
    tok = state.tokenizer
    max_len = state.max_model_len
    defaults = state.generation_defaults
    values = {**defaults.request_values(), **_common_values(body)}  # the model's defaults; the request's win
    echo = False
    drop_generated = False
    n_logprobs: int | None = None

    if chat:
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        add_gen = body.add_generation_prompt
        if add_gen is None:
            add_gen = not body.continue_final_message
        try:
            text = state.chat.render(messages, add_generation_prompt=add_gen,
                                     continue_final_message=bool(body.continue_final_message),
                                     documents=body.documents, chat_template_kwargs=body.chat_template_kwargs)
        except ChatTemplateError as err:
            raise APIError(400, str(err), param="messages", code="chat_template_error") from None
        if tok is None:
            raise APIError(400, "this model has no tokenizer, so chat is not available: use /v1/completions with "
                                "token ids", param="messages", code="no_tokenizer")
        prompts = [(text, list(tok.encode(text, add_special_tokens=False)))]
        max_tokens = body.max_tokens or body.max_completion_tokens
        if max_tokens is None:  # as vLLM: the model's max_new_tokens, at most what is left of the context
            left = max(1, max_len - len(prompts[0][1])) if max_len is not None else None
            max_tokens = min((v for v in (defaults.get("max_tokens"), left) if v is not None), default=None)
        values["max_tokens"] = max_tokens if max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        if body.logprobs:
            n_logprobs = body.top_logprobs or 0
            values["logprobs"] = n_logprobs
    else:
        prompts = _prompts_of(state, body)
        echo = bool(body.echo)
        max_tokens = body.max_tokens
        if max_tokens is None:  # as vLLM: OpenAI's 16, or the model's max_new_tokens if lower
            max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, defaults.get("max_tokens") or COMPLETION_DEFAULT_MAX_TOKENS)
        if max_tokens == 0:  # echo only: the prompt (and its logprobs), nothing generated
            drop_generated = True
            max_tokens = 1
        values["max_tokens"] = max_tokens
        if body.logprobs is not None:
            n_logprobs = body.logprobs
            values["logprobs"] = body.logprobs
            if echo and "prompt_logprobs" not in state.engine_fields:
                raise APIError(400, "echo with logprobs needs the prompt's logprobs, which this engine build does not "
                                    "support yet", param="echo", code="unsupported_parameter")
            if echo:
                values["prompt_logprobs"] = max(body.logprobs, values.get("prompt_logprobs") or 0)

    for i, (_, ids) in enumerate(prompts):
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt" if not chat else "messages", code="empty_prompt")
        if max_len is not None:
            need = len(ids) + (0 if drop_generated else values["max_tokens"])
            if len(ids) >= max_len or need > max_len:
                raise APIError(
                    400,
                    f"this model's maximum context length is {max_len} tokens; the request asks for {need} "
                    f"({len(ids)} in the {'messages' if chat else 'prompt'}"
                    f"{'' if len(prompts) == 1 else f' {i}'}, {values['max_tokens']} to generate)",
                    param="messages" if chat else "prompt", code="context_length_exceeded")

    params, fanout = _build_params(state, values)
    n = values.get("n", 1)
    await state.check_queue()

    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if body.user:
        logger.debug("%s: user %r", rid, body.user)
    subs: list[_Sub] = []
    for p, (text, ids) in enumerate(prompts):
        for s in range(fanout):
            sub_params = params
            if fanout > 1 and getattr(params, "seed", None) is not None:
                sub_params = dataclasses.replace(params, seed=(params.seed + s) % 2**32)
            subs.append(_Sub(f"{rid}-{p}-{s}", p, p * n + s, ids, text, sub_params, arrival=arrival,
                             width=n if fanout == 1 else 1))
    fan = _Fanout(state, subs)
    try:
        await _race_disconnect(fan.prime(), request)
    except _ClientGone:
        fan.close()
        return Response(status_code=499)
    except BaseException as err:
        fan.close()
        if isinstance(err, asyncio.CancelledError):
            raise
        raise _engine_error(err) from None

    # After the engine accepted the prompts: echoing decodes their token ids, which it has checked.
    choices: dict[int, _Choice] = {}
    try:
        for sub in subs:
            width = n if fanout == 1 else 1
            for k in range(width):
                echo_text = ""
                if echo:
                    echo_text = sub.prompt_text if sub.prompt_text is not None else (
                        tok.decode(sub.prompt_ids, skip_special_tokens=False) if tok is not None else "")
                choices[sub.base_choice + k] = _Choice(sub.base_choice + k, sub, echo_text, drop_generated)
    except BaseException:
        fan.close()  # the engine's requests are running: abort them rather than leave them orphaned
        raise

    ctx = _RequestContext(state, rid, model, chat, subs, choices, n_logprobs, echo, tok, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _SSEResponse(ctx.stream(fan, include_usage), on_close=fan.close, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        await _race_disconnect(ctx.collect(fan), request)
    except _ClientGone:
        return Response(status_code=499)
    except APIError:
        raise
    except asyncio.CancelledError:
        raise
    except BaseException as err:  # noqa: BLE001
        raise _engine_error(err) from None
    finally:
        fan.close()
    return JSONResponse(ctx.response())


class _SSEResponse(StreamingResponse):
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


class _RequestContext:
    def __init__(self, state: ServerState, rid: str, model: str, chat: bool, subs: list[_Sub],
                 choices: dict[int, _Choice], n_logprobs: int | None, echo: bool, tok: Any, body: Any):
        self.state, self.rid, self.model, self.chat = state, rid, model, chat
        self.subs, self.choices, self.n_logprobs, self.echo, self.body = subs, choices, n_logprobs, echo, body
        self.fmt = _Formatter(tok)
        self.created = int(time.time())
        self.prompt_logprobs: dict[int, list] = {}

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _observe(self, i: int, out: Any) -> list[tuple[_Choice, str, list[int], list, bool]]:
        sub = self.subs[i]
        now = time.monotonic()
        updates = []
        if out.outputs and any(o.token_ids for o in out.outputs) and sub.first_time is None:
            sub.first_time = now
            self.state.metrics.ttft.observe(now - sub.arrival)
            m = getattr(out, "metrics", None)
            if m is not None and getattr(m, "first_scheduled_time", None) and getattr(m, "arrival_time", None):
                self.state.metrics.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if getattr(out, "prompt_logprobs", None) is not None and i not in self.prompt_logprobs:
            self.prompt_logprobs[i] = list(out.prompt_logprobs)
        for o in out.outputs:
            choice = self.choices.get(sub.base_choice + o.index)
            if choice is None:
                continue
            updates.append((choice, *choice.update(o)))
        if getattr(out, "finished", False) and not sub.done:
            sub.done = True
            self.state.metrics.e2e.observe(now - sub.arrival)
            longest = max((len(o.token_ids) for o in out.outputs), default=0)
            if sub.first_time is not None and longest > 1:
                self.state.metrics.tpot.observe((now - sub.first_time) / (longest - 1))
            for o in out.outputs:
                self.state.metrics.finished.labels(finish_reason=str(o.finish_reason)).inc()
        return updates

    def usage(self) -> dict:
        prompt = sum(len(self.subs[i].prompt_ids) for i in self._first_sub_per_prompt())
        completion = sum(len(c.token_ids) for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _first_sub_per_prompt(self) -> list[int]:
        seen, out = set(), []
        for i, s in enumerate(self.subs):
            if s.prompt_index not in seen:
                seen.add(s.prompt_index)
                out.append(i)
        return out

    def _echo_logprobs(self, choice: _Choice) -> tuple[list[int], list]:
        i = self.subs.index(choice.sub)
        entries = self.prompt_logprobs.get(i)
        ids = choice.sub.prompt_ids
        if entries is None:
            entries = [None] * len(ids)
        return ids, entries

    # ---- non-streaming ---------------------------------------------------------------------------
    async def collect(self, fan: _Fanout) -> None:
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
                choice = {"index": idx, "message": {"role": "assistant", "content": c.text},
                          "logprobs": lps, "finish_reason": c.finish_reason}
            else:
                choice = {"index": idx, "text": c.echo_text + c.text, "logprobs": lps,
                          "finish_reason": c.finish_reason}
            if self.body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.fmt.prompt_logprobs(self._echo_logprobs(c)[1])
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage()}

    # ---- streaming -------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage: Any = None, include_usage: bool = False) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if include_usage:
            chunk["usage"] = usage
        return f"data: {_dumps(chunk)}\n\n"

    async def stream(self, fan: _Fanout, include_usage: bool) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield self._chunk([{"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None} for idx in sorted(self.choices)], None, include_usage)
            async for i, out in fan.events():
                pieces = []
                for choice, delta, new_ids, new_lps, just_finished in self._observe(i, out):
                    piece = self._stream_piece(choice, delta, new_ids, new_lps, just_finished)
                    if piece is not None:
                        pieces.append(piece)
                if pieces:
                    yield self._chunk(pieces, None, include_usage)
            if include_usage:
                yield self._chunk([], self.usage(), True)
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - headers are sent: report in-band, then end the stream
            api = _engine_error(err)
            yield f"data: {_dumps(error_body(api.status, api.message, type=api.type, code=api.code))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            fan.close()

    def _stream_piece(self, c: _Choice, delta: str, new_ids: list[int], new_lps: list, finished: bool) -> dict | None:
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
                lps, end = self.fmt.completion_logprobs(echo_ids + new_ids, echo_entries + new_lps, self.n_logprobs,
                                                        offset)
                c.offset = end
        reason = c.finish_reason if finished else None
        if self.chat:
            d = {"content": delta} if (delta or not finished) else {}
            piece = {"index": c.index, "delta": d, "logprobs": lps, "finish_reason": reason}
        else:
            piece = {"index": c.index, "text": echo_part + delta, "logprobs": lps, "finish_reason": reason}
        if self.body.prompt_logprobs is not None and not c.prompt_lps_sent:
            c.prompt_lps_sent = True
            piece["prompt_logprobs"] = self.fmt.prompt_logprobs(self._echo_logprobs(c)[1])
        return piece
