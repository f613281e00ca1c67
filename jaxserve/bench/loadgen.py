"""The load generator: streamed requests to an OpenAI-compatible server at a request rate, timed per token.

Arrivals are a gamma process (vLLM's `--burstiness`: shape 1 is Poisson at `rate`, smaller is
burstier) or all at once (`rate` inf), with at most `max_concurrency` requests in flight. Every
request streams (`stream_options.include_usage`), so each chunk is timed as it arrives: a chunk that
carries new tokens is one step of the server's output, whatever its text (a server without a
tokenizer sends empty text). Token counts come from the server's final `usage` chunk when it sends one.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from typing import Any, Callable, Sequence

from jaxserve.bench.datasets import SampleRequest, as_completion_prompt, as_messages
from jaxserve.bench.http import Client, HTTPError
from jaxserve.bench.metrics import RequestResult

CHAT = "/v1/chat/completions"


def request_body(
    req: SampleRequest,
    endpoint: str,
    model: str,
    *,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    extra: dict | None = None,
) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": temperature,
    }
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's, jaxserve's and llama-server's extension of the protocol
    if endpoint.endswith("chat/completions"):
        body["messages"] = as_messages(req.prompt)
    else:
        body["prompt"] = as_completion_prompt(req.prompt)
    body.update(extra or {})
    return body


async def send(client: Client, endpoint: str, body: dict, req: SampleRequest, timeout: float = 600.0) -> RequestResult:
    """One streamed request; never raises for the server's or the network's failures (they are the result's error)."""
    result = RequestResult(req.index, input_len=req.input_len)
    start = result.start = time.perf_counter()
    last = None
    chunks = 0
    usage: dict = {}
    try:
        async with asyncio.timeout(timeout):
            async with client.request("POST", endpoint, body) as r:
                if r.status != 200:
                    result.error = f"HTTP {r.status}: {(await r.read())[:300].decode(errors='replace')}"
                    return result
                async for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    data = json.loads(payload)
                    if "error" in data:
                        error = data["error"]
                        result.error = str(error.get("message") if isinstance(error, dict) else error)
                        return result
                    if data.get("usage"):
                        usage = data["usage"]
                    if not data.get("choices"):
                        continue
                    choice = data["choices"][0]
                    delta = choice.get("delta") or {}
                    if delta.get("role") and not delta.get("content") and not choice.get("finish_reason"):
                        continue  # chat's opening role chunk carries no token
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                await r.read()  # the rest of the body, so the connection can be reused
    except (HTTPError, OSError, asyncio.IncompleteReadError, json.JSONDecodeError, TimeoutError, ValueError) as err:
        result.error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        return result
    result.e2el = time.perf_counter() - start
    result.output_tokens = usage.get("completion_tokens", chunks) if usage else chunks
    if usage.get("prompt_tokens"):
        result.input_len = int(usage["prompt_tokens"])
    result.ok = last is not None
    if not result.ok:
        result.error = "no tokens received"
    return result


def arrival_gaps(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds between one request and the next: gamma(shape=burstiness, mean 1/rate), or 0 at rate inf."""
    if not math.isfinite(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def run_load(
    client: Client,
    requests: Sequence[SampleRequest],
    endpoint: str,
    model: str,
    rate: float,
    *,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    timeout: float = 600.0,
    on_done: Callable[[RequestResult], None] | None = None,
    **body_options: Any,
) -> tuple[list[RequestResult], float]:
    """Send `requests` at `rate` (requests/s or inf), at most `max_concurrency` in flight; returns the
    results in request order and the wall time from the first send to the last reply, in seconds.
    `body_options`: request_body's ignore_eos, temperature, extra."""
    limit = asyncio.Semaphore(max_concurrency or max(1, len(requests)))
    gaps = arrival_gaps(len(requests), rate, burstiness, seed)

    async def one(req: SampleRequest) -> RequestResult:
        async with limit:
            result = await send(client, endpoint, request_body(req, endpoint, model, **body_options), req, timeout)
        if on_done is not None:
            on_done(result)
        return result

    tasks = []
    start = time.perf_counter()
    for req, gap in zip(requests, gaps):
        tasks.append(asyncio.create_task(one(req)))
        if gap > 0:
            await asyncio.sleep(gap)
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


async def first_model(client: Client) -> str:
    """The first model the server lists (GET /v1/models): the name requests carry when none is given."""
    status, body = await client.get("/v1/models")
    if status != 200:
        raise HTTPError(f"GET /v1/models answered {status}: {body[:200].decode(errors='replace')}")
    return json.loads(body)["data"][0]["id"]


async def wait_until_ready(client: Client, timeout: float) -> float:
    """Poll until the server serves: /health 200 (jaxserve, vLLM, llama-server), or, where there is no
    /health (404), /v1/models 200. Returns the seconds waited; raises TimeoutError after `timeout`."""
    start = time.perf_counter()
    while True:
        try:
            status, _ = await client.get("/health")
            if status == 404:
                status, _ = await client.get("/v1/models")
            if status == 200:
                return time.perf_counter() - start
        except (HTTPError, OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"the server at {client.host}:{client.port} was not ready within {timeout:.0f} s")
        await asyncio.sleep(0.5)
