"""The OpenAI-compatible FastAPI app: routes, auth and body limits, errors. Reading path of a request:
`completions` / `chat_completions` here -> `requests.translate` (body -> prompts + SamplingParams, the 400s)
-> `streaming.respond` (engine requests, response or SSE stream) -> `ServingEngine.generate`.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings (server/embeddings.py: a
--runner pooling engine; a generation engine answers it with a 400), POST /v1/responses with GET and DELETE
/v1/responses/{id} (OpenAI's Responses API over the chat path: server/responses.py), GET /v1/models,
GET /v1/capabilities, GET /health (200 only once the engine is warm and while not draining), GET /metrics (Prometheus),
POST /tokenize and POST /detokenize (vLLM's; like /health and /metrics, outside the /v1 API-key gate);
with --allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), vLLM's POST /v1/load_lora_adapter
and POST /v1/unload_lora_adapter (server/lora.py). A request's `model` may name a loaded LoRA adapter.

Errors are OpenAI-style objects, `{"error": {"message", "type", "param", "code"}}`:
  400  body not JSON (code invalid_json); a field of the wrong type or out of its documented range, a
       missing required field, a body that is not an object (validation_error: never FastAPI's 422,
       as in OpenAI and vLLM); a parameter jaxserve does not support (named); a request the engine
       rejects (prompt too long, bad token ids, ...). Type "invalid_request_error" throughout.
  401  /v1/* without `Authorization: Bearer <--api-key>` (when an API key is set)
  404  unknown model name (neither a served name nor a loaded LoRA adapter); unknown route
  413  body over --max-body-bytes
  503  engine not warm yet, server draining, or more than --max-waiting requests already waiting
  500  an unexpected failure while processing this one request (the server keeps serving)
A streamed request that fails after its first chunk ends with an SSE `data: {"error": ...}` event
followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import secrets
import time
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.sampling.params import MAX_LOGIT_BIAS, SamplingParams
from jaxserve.server.embeddings import EMBEDDINGS_ROUTE, add_embeddings_routes, refuse_generation
from jaxserve.server.engine_protocol import ServingEngine
from jaxserve.server.errors import APIError, dumps, error_body, error_response
from jaxserve.server.lora import LORA_ROUTES, add_lora_routes
from jaxserve.server.sleep_routes import add_sleep_routes
from jaxserve.server.protocol import (
    KNOWN_UNSUPPORTED,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from jaxserve.server.requests import translate
from jaxserve.server.responses import RESPONSES_ROUTE, add_responses_routes
from jaxserve.server.state import ServerOptions, ServerState
from jaxserve.server.streaming import respond
from jaxserve.server.tokenization import detokenize, tokenize

logger = logging.getLogger(__name__)

__all__ = ["APIError", "ServerOptions", "ServerState", "create_app"]


_SAMPLING_PARAMS = sorted(f.name for f in dataclasses.fields(SamplingParams))


# ==============================================================================================
# Gate middleware: API key (401), body size (413), status counters.
# ==============================================================================================

_KNOWN_ROUTES = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/capabilities",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    RESPONSES_ROUTE,
    EMBEDDINGS_ROUTE,
    *LORA_ROUTES,
}


class GateMiddleware:
    def __init__(self, app: Callable, state: ServerState):
        self.app = app
        self.state = state

    async def _send_error(self, send, status: int, message: str, **kw: Any) -> None:
        body = dumps(error_body(status, message, **kw)).encode()
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
                    send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
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
# The app
# ==============================================================================================


def create_app(
    options: ServerOptions | None = None, engine: ServingEngine | None = None, shutdown_engine: bool = False
) -> FastAPI:
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

    app = FastAPI(
        title="jaxserve",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible LLM inference server over jaxserve's JAX engine.",
    )
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
            return error_response(
                400, "; ".join(sorted({e["msg"] for e in unsupported})), param=fields[0], code="unsupported_parameter"
            )
        combos = [e for e in errors if e.get("type") == "invalid_combination"]
        if combos:
            return error_response(
                400,
                combos[0]["msg"],
                param=(combos[0].get("ctx") or {}).get("field"),
                code="invalid_parameter_combination",
            )
        parts, first_param = [], None
        for e in errors[:8]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            where = ".".join(loc) or "body"
            first_param = first_param or (loc[0] if loc else None)
            parts.append(f"{where}: {e.get('msg')}")
        return error_response(400, "invalid request: " + "; ".join(parts), param=first_param, code="validation_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(
            error_body(err.status_code, str(err.detail)),
            status_code=err.status_code,
            headers=getattr(err, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        logger.exception("unhandled error in %s", request.url.path)
        return error_response(500, f"internal error: {type(err).__name__}", code="internal_error")

    # ---- simple routes ---------------------------------------------------------------------------
    err_responses = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)}

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
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "jaxserve",
                "root": options.model_path,
                "parent": None,
                "max_model_len": state.max_model_len,
            }
            for name in options.served_model_names
        ]
        return {"object": "list", "data": cards + state.lora.cards()}  # the adapters loaded now

    @app.get("/v1/capabilities", responses=err_responses)
    async def capabilities():
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
            "endpoints": [
                "POST /v1/completions",
                "POST /v1/chat/completions",
                f"POST {RESPONSES_ROUTE}",
                f"GET {RESPONSES_ROUTE}/{{id}}",
                f"DELETE {RESPONSES_ROUTE}/{{id}}",
                "GET /v1/models",
                "GET /v1/capabilities",
                "GET /health",
                "GET /metrics",
                "POST /tokenize",
                "POST /detokenize",
                f"POST {EMBEDDINGS_ROUTE}",
            ]
            + ([f"POST {r}" for r in LORA_ROUTES] if state.lora.runtime_updating else []),
            "lora": state.lora.describe(),
            "completions": {"fields": sorted(CompletionRequest.model_fields)},
            "chat_completions": {
                "fields": sorted(ChatCompletionRequest.model_fields),
                "roles": ["system", "developer", "user", "assistant", "tool"],
                "content_parts": ["text"],
            },
            "tool_choice": ["none", "auto", "required", "function"],
            "tool_call_parser": options.tool_call_parser,
            "reasoning_parser": options.reasoning_parser,
            "response_format": ["text", "json_object", "json_schema"],
            "structured_outputs": ["json", "regex", "choice", "grammar", "json_object"],
            "stream_options": ["include_usage"],
            "limits": {
                "max_n": MAX_N,
                "max_prompts": MAX_PROMPTS,
                "max_logprobs": MAX_LOGPROBS,
                "max_logit_bias": MAX_LOGIT_BIAS,
                "max_body_bytes": options.max_body_bytes,
                "max_waiting": options.max_waiting,
            },
            # every engine takes all of SamplingParams (n, stop strings, penalties, logprobs, ...)
            "engine_sampling_params": _SAMPLING_PARAMS if state.ready else [],
            # tools and tool_choice are chat fields: refused only by /v1/completions
            "rejected_parameters": sorted(set(KNOWN_UNSUPPORTED) - set(ChatCompletionRequest.model_fields)),
        }

    # ---- generation routes -----------------------------------------------------------------------
    @app.post("/v1/completions", response_model=CompletionResponse, responses=err_responses)
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(state, request, body, chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=err_responses)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(state, request, body, chat=True)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=err_responses)
    async def tokenize_route(body: TokenizeRequest):
        state.check_ready()
        state.check_model(body.model)
        return tokenize(state, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=err_responses)
    async def detokenize_route(body: DetokenizeRequest):
        state.check_ready()
        state.check_model(body.model)
        return detokenize(state, body)

    add_responses_routes(app, state, err_responses)  # POST /v1/responses, GET and DELETE /v1/responses/{id}
    add_embeddings_routes(app, state, err_responses)  # POST /v1/embeddings (a --runner pooling engine)
    if state.lora.runtime_updating:
        add_lora_routes(app, state, err_responses)
    add_sleep_routes(app, state)  # /sleep, /wake_up, /pause, ...: 404 without --enable-sleep-mode

    app.openapi = functools.partial(_openapi_without_422, app.openapi)
    return app


def _openapi_without_422(build: Callable[[], dict]) -> dict:
    """The app's OpenAPI schema (`build`: FastAPI's app.openapi, which caches it) without the 422 that
    FastAPI adds to every route taking a body (its validation errors are 400s here, documented as
    ErrorResponse), nor that 422's schemas."""
    schema = build()
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            if isinstance(operation, dict):
                operation.get("responses", {}).pop("422", None)
    paths = json.dumps(schema.get("paths", {}))
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        if f'"#/components/schemas/{name}"' not in paths:
            components.pop(name, None)
    return schema


async def _generate(
    state: ServerState, request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool
) -> Response:
    """Both generation routes: the checks (503, 404), translation (400), the queue bound (503), then the engine."""
    arrival = time.monotonic()
    state.check_ready()
    refuse_generation(state)
    model, lora_request = state.check_model(body.model)
    job = translate(state, body, chat, lora_request=lora_request)
    await state.check_queue()
    if body.user:
        logger.debug("%s: user %r", job.request_id, body.user)
    return await respond(state, request, body, job, job.request_id, model, arrival)
