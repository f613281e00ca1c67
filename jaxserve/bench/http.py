"""A small HTTP/1.1 client on asyncio streams: what `jaxserve bench serve` needs to stream from a server.

The benchmark must run from a bare install of the package, no extras (httpx and aiohttp are not run-time
dependencies), against any OpenAI-compatible server. It needs little: JSON requests, responses read
whole or as lines (server-sent events), Content-Length and chunked bodies, keep-alive connections kept
in a pool (a fresh TCP connection per request would add its set-up to every TTFT), and TLS for https.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024


class HTTPError(ConnectionError):
    """The server broke the protocol or the connection (not an HTTP error status: those are responses)."""


class Response:
    """Status, headers (lower-case names) and the body, read once: `read()`, `iter_bytes()` or `iter_lines()`."""

    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader, method: str):
        self.status, self.headers, self._reader = status, headers, reader
        self.complete = False  # the whole body was read: the connection may carry the next request
        self._no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        reader = self._reader
        if self._no_body:
            self.complete = True
            return
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                if not size_line:
                    raise HTTPError("connection closed inside a chunked body")
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()).strip():  # trailers, then the blank line
                        pass
                    self.complete = True
                    return
                data = await reader.readexactly(size)
                await reader.readexactly(2)  # the chunk's CRLF
                yield data
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left:
                data = await reader.read(min(left, 65536))
                if not data:
                    raise HTTPError(f"connection closed with {left} bytes of the body unread")
                left -= len(data)
                yield data
            self.complete = True
        else:  # the body runs to the end of the connection
            while data := await reader.read(65536):
                yield data

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_bytes()])

    async def json(self) -> Any:
        return json.loads(await self.read())

    async def iter_lines(self) -> AsyncIterator[str]:
        """The body's lines without their line ends (what server-sent events are made of)."""
        pending = b""
        async for chunk in self.iter_bytes():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", errors="replace")


class Client:
    """Requests to one server (`base_url`: http[s]://host[:port][/prefix]) over pooled keep-alive connections."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str] | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 30.0,
    ):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        default_port = self.port == (443 if self.ssl else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.headers = dict(headers or {})
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=2**20), self.connect_timeout
        )

    @contextlib.asynccontextmanager
    async def request(self, method: str, path: str, body: Any = None) -> AsyncIterator[Response]:
        """Send one request (`body`: JSON-encoded when given) and yield the response once its head has
        arrived; the body is the caller's to read. Raises HTTPError (or OSError) when the connection fails."""
        payload = b"" if body is None else json.dumps(body).encode()
        head = [
            f"{method} {self.prefix}{path} HTTP/1.1",
            f"Host: {self.host_header}",
            "Accept: */*",
            "User-Agent: jaxserve-bench",
        ]
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + payload
        for attempt in range(2):  # a pooled connection the server has closed meanwhile: once more on a new one
            reused = bool(self._idle)
            reader, writer = await self._connect()
            try:
                writer.write(request)
                await writer.drain()
                status_line = await reader.readline()
                if not status_line:
                    raise HTTPError("the server closed the connection before answering")
                break
            except ConnectionError as err:  # HTTPError included
                writer.close()
                if reused and not attempt:
                    continue
                if isinstance(err, HTTPError):
                    raise
                raise HTTPError(f"{type(err).__name__}: {err}") from err
        response = await self._read_head(status_line, reader, method)
        try:
            yield response
        finally:
            keep = response.complete and response.headers.get("connection", "").lower() != "close"
            if keep:
                self._idle.append((reader, writer))
            else:
                writer.close()

    @staticmethod
    async def _read_head(status_line: bytes, reader: asyncio.StreamReader, method: str) -> Response:
        parts = status_line.decode("latin-1").split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise HTTPError(f"not an HTTP response: {status_line[:80]!r}")
        headers: dict[str, str] = {}
        size = len(status_line)
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            size += len(line)
            if size > MAX_HEAD_BYTES:
                raise HTTPError("response head too large")
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return Response(int(parts[1]), headers, reader, method)

    async def get(self, path: str) -> tuple[int, bytes]:
        async with self.request("GET", path) as r:
            return r.status, await asyncio.wait_for(r.read(), self.timeout)

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
