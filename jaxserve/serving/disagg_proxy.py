"""A prefill/decode proxy: one OpenAI endpoint in front of prefill servers and decode servers.

vLLM's toy P/D proxy, for jaxserve servers started with the `JaxTransferConnector`
(docs/disaggregation.md). For each /v1/completions or /v1/chat/completions request:

1. the request goes to a prefill server with `max_tokens` 1, not streamed, and
   `kv_transfer_params: {"do_remote_decode": true}`; its response's `kv_transfer_params` say where
   its prompt's pages wait;
2. the original request, those params added, goes to a decode server, whose answer (streamed or not)
   is the client's.

Servers are taken least busy first (requests in flight through this proxy; ties in turn). Faults: a
prefill or decode server that cannot be reached, or answers 5xx before anything reached the client,
is retried on another of its kind (`--retries`); once a stream has started, a failure ends it with
an in-band error event. A server's 4xx (the client's bad input) is the client's answer, unchanged. A
decode server that cannot pull the pages recomputes the prompt (the output is the same). Responses
carry `x-jaxserve-prefill` and `x-jaxserve-decode`: the servers that served them.

    python -m jaxserve.serving.disagg_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxserve.bench.http import Client, HTTPError

logger = logging.getLogger(__name__)

# What the prefill must not inherit: it answers one token, whole, and nothing else.
_PREFILL_DROPS = ("stream_options", "min_tokens", "n", "best_of")


class Upstream:
    """One server: its client and the requests in flight to it."""

    def __init__(self, url: str, timeout: float):
        self.url = url.rstrip("/")
        self.client = Client(self.url, timeout=timeout, connect_timeout=10.0)
        self.in_flight = 0


class Pool:
    """Servers of one kind, least busy first (ties in turn)."""

    def __init__(self, urls: Sequence[str], timeout: float):
        if not urls:
            raise ValueError("at least one server of each kind is needed")
        self.servers = [Upstream(u, timeout) for u in urls]
        self._turn = itertools.count()

    def order(self) -> list[Upstream]:
        start = next(self._turn) % len(self.servers)
        rotated = self.servers[start:] + self.servers[:start]
        return sorted(rotated, key=lambda s: s.in_flight)


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "proxy_error", "code": code}}, status_code=status)


def prefill_body(body: dict) -> dict:
    """The prefill's request: the client's, one token, whole, and asking for its pages to be kept."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class DisaggProxy:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], retries: int = 2, timeout: float = 600.0):
        self.prefill, self.decode = Pool(prefill, timeout), Pool(decode, timeout)
        self.retries = retries
        self.counts = dict.fromkeys(("requests", "prefill_retries", "decode_retries", "failed"), 0)

    def _attempts(self, pool: Pool, kind: str) -> Iterator[Upstream]:
        """The servers of `pool` to try in turn, at most `retries` + 1; each try after the first is
        counted as a `kind` retry."""
        for attempt, server in enumerate(pool.order()[: self.retries + 1]):
            if attempt:
                self.counts[f"{kind}_retries"] += 1
            yield server

    async def _prefill(self, path: str, body: dict) -> tuple[Upstream | None, int, Any]:
        """(server, status, JSON body) of the first prefill server that answers below 500."""
        last = "no prefill server answered"
        for server in self._attempts(self.prefill, "prefill"):
            server.in_flight += 1
            try:
                async with server.client.request("POST", path, prefill_body(body)) as r:
                    payload = await r.json()
                if r.status < 500:
                    return server, r.status, payload
                last = f"prefill server {server.url} answered {r.status}: {payload}"
            except (TimeoutError, HTTPError, OSError, json.JSONDecodeError) as e:
                last = f"prefill server {server.url} failed: {type(e).__name__}: {e}"
            finally:
                server.in_flight -= 1
            logger.warning("%s; trying another", last)
        return None, 503, last

    async def handle(self, path: str, request: Request) -> Response:
        self.counts["requests"] += 1
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return _error(400, f"the request body is not JSON: {e}", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request")
        if body.get("n", 1) != 1:
            return _error(400, "n > 1 is not supported behind the prefill/decode proxy", "invalid_request")
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params is the proxy's to set", "invalid_request")
        server, status, payload = await self._prefill(path, body)
        if server is None:
            self.counts["failed"] += 1
            return _error(503, str(payload), "prefill_unavailable")
        if status != 200:  # the client's bad input: the prefill server's own answer
            return JSONResponse(payload, status_code=status)
        params = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
        decode_body = dict(body, kv_transfer_params=params) if params else body
        headers = {"x-jaxserve-prefill": server.url}
        if body.get("stream"):
            return await self._decode_stream(path, decode_body, headers)
        return await self._decode(path, decode_body, headers)

    async def _decode(self, path: str, body: dict, headers: dict) -> Response:
        last = "no decode server answered"
        for server in self._attempts(self.decode, "decode"):
            server.in_flight += 1
            try:
                async with server.client.request("POST", path, body) as r:
                    payload = await r.read()
                if r.status < 500:
                    return Response(
                        payload,
                        status_code=r.status,
                        media_type="application/json",
                        headers={**headers, "x-jaxserve-decode": server.url},
                    )
                last = f"decode server {server.url} answered {r.status}: {payload[:300]!r}"
            except (TimeoutError, HTTPError, OSError) as e:
                last = f"decode server {server.url} failed: {type(e).__name__}: {e}"
            finally:
                server.in_flight -= 1
            logger.warning("%s; trying another", last)
        self.counts["failed"] += 1
        return _error(503, last, "decode_unavailable")

    async def _decode_stream(self, path: str, body: dict, headers: dict) -> Response:
        """Open the stream on the first decode server that answers its head below 500, then relay it."""
        last = "no decode server answered"
        for server in self._attempts(self.decode, "decode"):
            server.in_flight += 1
            ctx = server.client.request("POST", path, body)
            try:
                r = await ctx.__aenter__()
            except (TimeoutError, HTTPError, OSError) as e:
                server.in_flight -= 1
                last = f"decode server {server.url} failed: {type(e).__name__}: {e}"
                logger.warning("%s; trying another", last)
                continue
            if r.status >= 400:
                payload = await r.read()
                await ctx.__aexit__(None, None, None)
                server.in_flight -= 1
                if r.status < 500:
                    return Response(payload, status_code=r.status, media_type="application/json", headers=headers)
                last = f"decode server {server.url} answered {r.status}: {payload[:300]!r}"
                logger.warning("%s; trying another", last)
                continue
            return StreamingResponse(
                self._relay(server, ctx, r),
                media_type="text/event-stream",
                headers={**headers, "x-jaxserve-decode": server.url},
            )
        self.counts["failed"] += 1
        return _error(503, last, "decode_unavailable")

    async def _relay(self, server: Upstream, ctx: Any, r: Any) -> AsyncIterator[bytes]:
        try:
            async for chunk in r.iter_bytes():
                yield chunk
        except (TimeoutError, HTTPError, OSError) as e:
            self.counts["failed"] += 1
            error = {"message": f"decode server {server.url} failed mid-stream: {e}", "type": "proxy_error"}
            yield f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
        finally:
            server.in_flight -= 1
            await ctx.__aexit__(None, None, None)

    async def close(self) -> None:
        for server in self.prefill.servers + self.decode.servers:
            await server.client.close()


def create_app(proxy: DisaggProxy) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await proxy.close()

    app = FastAPI(title="jaxserve prefill/decode proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models():
        for server in proxy.decode.order():
            try:
                status, payload = await server.client.get("/v1/models")
                return Response(payload, status_code=status, media_type="application/json")
            except (TimeoutError, HTTPError, OSError):
                continue
        return _error(503, "no decode server answered", "decode_unavailable")

    @app.get("/health")
    async def health():
        return {"status": "ok", **proxy.counts}

    return app


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", nargs="+", required=True, help="prefill servers' base URLs (kv_producer)")
    p.add_argument("--decode", nargs="+", required=True, help="decode servers' base URLs (kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--retries", type=int, default=2, help="other servers of a kind tried after one fails")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds an upstream answer may take")
    args = p.parse_args(argv)
    proxy = DisaggProxy(args.prefill, args.decode, retries=args.retries, timeout=args.timeout)
    uvicorn.run(create_app(proxy), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
