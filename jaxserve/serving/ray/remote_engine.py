"""The ingress's engine: a `ServingEngine` (jaxserve/server/engine_protocol.py) whose requests run on
the engine deployment's replicas, reached through a streaming DeploymentHandle, so the whole OpenAI
server (streaming, n > 1, logprobs, tools) runs unchanged in front of it.

The wire protocol of `EngineReplica.generate` (deployments.py): the first item is the replica's id
once its engine accepted the request, or the exception its check raised (the server's 400); then the
request's RequestOutput deltas, the last one `finished`, or an exception. Exceptions travel as values,
not raised, so the server gets the engine's own RequestError and never Ray's wrapper of it.

`ReplicaHeader` adds `x-jaxserve-replica` (the engine replicas that served the request) to every
generation response: `submit` notes the replica in a per-request holder the middleware set up, before
the first delta reaches the server, which waits for each prompt's first delta before it answers.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.engine.processor import EngineRequest, Limits, Processor, claim
from jaxserve.errors import JaxServeError

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-jaxserve-replica"

# The replicas that served the HTTP request being handled (a list the ReplicaHeader middleware owns).
_served_by: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("jaxserve_served_by", default=None)


class ReplicaHeader:
    """ASGI middleware: `x-jaxserve-replica: ID[,ID...]` on responses an engine replica served."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        holder: list[str] = []
        token = _served_by.set(holder)

        async def send_with_replica(message):
            if message["type"] == "http.response.start" and holder:
                value = ",".join(dict.fromkeys(holder)).encode("latin-1")
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER.encode(), value)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_replica)
        finally:
            _served_by.reset(token)


class ReplicaUnavailable(JaxServeError):
    """The engine deployment could not take or finish the request (a replica died, Ray failed): the
    server's 503, or an in-band error event once a stream has begun."""


class RemoteEngine:
    """A ServingEngine over the engine deployment. `handle`: the deployment's DeploymentHandle with
    `stream=True`; `max_model_len` and `config` come from a replica (`EngineReplica.info`)."""

    def __init__(
        self,
        handle: Any,
        tokenizer: Any,
        max_model_len: int | None,
        config: EngineConfig | None,
        limits: Limits,
        retries: int = 2,
    ):
        self._handle = handle
        # The one way in, here at the ingress over the replicas' limits: a replica takes what it made.
        self.processor = Processor(limits, tokenizer)
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._config = config
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pumps: dict[str, asyncio.Task] = {}  # request id -> the task forwarding its deltas
        self._accepting = 0  # submitted, not yet accepted by a replica
        self.retries = retries  # times a request nobody accepted yet goes to another replica

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    @property
    def config(self) -> EngineConfig | None:
        return self._config

    def start(self) -> None:
        """Nothing to start: the replicas run their own engines."""

    def shutdown(self) -> None:
        """Stop forwarding; the replicas' requests are cancelled with their generators."""
        for task in list(self._pumps.values()):
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(task.cancel)

    async def submit(self, request: EngineRequest, queue: asyncio.Queue, tag: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        request_id = request.request_id
        claim(request_id, self._pumps)
        self._accepting += 1
        try:
            stream, first = await self._place(request)
        finally:
            self._accepting -= 1
        if isinstance(first, BaseException):
            raise first
        served = _served_by.get()
        if served is not None:
            served.append(str(first))
        self._pumps[request_id] = asyncio.create_task(self._pump(request_id, stream, queue, tag))

    async def _place(self, request: EngineRequest) -> tuple[Any, Any]:
        """Send the request to a replica and wait for its acceptance (or refusal). A replica that fails
        before accepting (it died, Ray lost it) has streamed nothing: the request goes to another one."""
        request_id = request.request_id
        for attempt in range(self.retries + 1):
            stream = self._handle.generate.remote(request)
            try:
                return stream, await stream.__anext__()
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except Exception as err:  # noqa: BLE001 - Ray's errors; refusals arrive as values, not here
                failure = err
                logger.warning(
                    "request %s: no replica accepted it (attempt %d of %d): %s",
                    request_id,
                    attempt + 1,
                    self.retries + 1,
                    err,
                )
        raise ReplicaUnavailable(f"no engine replica took the request: {type(failure).__name__}: {failure}")

    async def _pump(self, request_id: str, stream: Any, queue: asyncio.Queue, tag: Any) -> None:
        try:
            async for item in stream:
                queue.put_nowait((tag, item))
                if isinstance(item, BaseException) or item.finished:
                    return
            queue.put_nowait((tag, ReplicaUnavailable("the engine replica ended the request without finishing it")))
        except asyncio.CancelledError:  # aborted: the replica's generator is cancelled, its engine aborts
            stream.cancel()
        except Exception as err:  # noqa: BLE001 - the replica died mid-request: fail this request only
            logger.warning("request %s failed on its engine replica: %s", request_id, err)
            queue.put_nowait((tag, ReplicaUnavailable(f"the engine replica failed: {type(err).__name__}: {err}")))
        finally:
            self._pumps.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        task = self._pumps.get(request_id)
        if task is None or self._loop is None or self._loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            task.cancel()
        else:
            self._loop.call_soon_threadsafe(task.cancel)

    def stats(self) -> dict[str, Any]:
        """This ingress replica's view: requests waiting for a replica to accept them, and streaming."""
        return {"num_waiting": self._accepting, "num_running": len(self._pumps)}
