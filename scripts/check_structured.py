"""Acceptance check of structured output and tool calls (issue 23) with the official `openai` client.

Starts `python -m jaxserve.serve` on the shipped default model (or uses a running server, `--url`) and runs,
all sampled (temperature 1, seeded):
- `client.chat.completions.parse(..., response_format=User)`: 20 requests, max_tokens 400, on a bounded
  pydantic schema (a nested object, a list with maxItems of strings with maxLength, an enum, a bounded
  integer, optional fields); a request cut by max_tokens (`LengthFinishReasonError`) is a failure.
- `guided_regex` and `guided_choice` on /v1/completions: 200 completions each, counting full matches.
- `tool_choice="required"` with two functions, 50 requests streamed and 50 not: a pass is finish_reason
  "tool_calls" with at least one call, every call naming one of the functions with arguments that validate
  against its schema (jsonschema if installed, else the functions' pydantic models); the streamed ones
  are folded from OpenAI's deltas (the first delta of a call must carry id, type, name and arguments "").
With `--throughput`, also output tokens/s of chat completions under the `User` schema against free ones
of the same number of tokens (`ignore_eos`, max_tokens the constrained replies' mean length), with 1 and
16 clients each keeping one request in flight, and the host time spent on grammar masks per engine step
(from /metrics). Prints one JSON report (and writes it to --out).

    python scripts/check_structured.py                       # starts the server (default config)
    python scripts/check_structured.py --url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Literal, Optional

import httpx
import openai
from pydantic import BaseModel, ConfigDict, Field, ValidationError

REPO = Path(__file__).resolve().parents[1]


# ---- the schemas ------------------------------------------------------------------------------------


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=20)
    zip_code: str = Field(max_length=10)


class User(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "editor", "viewer"]
    address: Address
    tags: list[Annotated[str, Field(max_length=12)]] = Field(max_length=4)
    nickname: Optional[str] = Field(default=None, max_length=16)
    score: Optional[int] = Field(default=None, ge=1, le=10)


class GetWeather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]
    days: Optional[int] = Field(default=None, ge=1, le=7)


class GetTime(BaseModel):
    model_config = ConfigDict(extra="forbid")
    zone: Literal["UTC", "CET", "PST", "JST"]
    offset_hours: int = Field(ge=-12, le=12)


FUNCTIONS = {
    "get_weather": (GetWeather, "The weather in a city for the next days"),
    "get_time": (GetTime, "The current time in a time zone"),
}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": doc, "parameters": model.model_json_schema()}}
    for name, (model, doc) in FUNCTIONS.items()
]
REGEX = r"[A-Z]{2}\d{3}"
CHOICES = ["red", "green", "blue", "yellow"]


def validator():
    """(name, arguments text) -> None or the reason it fails; jsonschema when installed, else pydantic."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None

    def check(name: str, arguments: str) -> str | None:
        if name not in FUNCTIONS:
            return f"unknown function {name!r}"
        model = FUNCTIONS[name][0]
        try:
            if jsonschema is not None:
                jsonschema.validate(json.loads(arguments), model.model_json_schema())
            else:
                model.model_validate_json(arguments)
        except (ValueError, ValidationError) as err:  # jsonschema's ValidationError is a ValueError too
            return f"{name}: {str(err).splitlines()[0]}"
        except Exception as err:  # noqa: BLE001 - jsonschema.ValidationError
            return f"{name}: {type(err).__name__}: {str(err).splitlines()[0]}"
        return None

    return check, ("jsonschema" if jsonschema is not None else "pydantic")


# ---- the checks -------------------------------------------------------------------------------------


def check_parse(client: openai.OpenAI, n: int, workers: int) -> dict:
    def one(seed: int):
        try:
            completion = client.chat.completions.parse(
                model=MODEL,
                messages=[
                    {"role": "system", "content": "Answer in JSON."},
                    {"role": "user", "content": "Make up a user profile."},
                ],
                response_format=User,
                max_tokens=400,
                temperature=1.0,
                seed=seed,
            )
        except openai.LengthFinishReasonError:
            return False, "cut by max_tokens"
        except (openai.APIError, ValidationError, ValueError) as err:
            return False, f"{type(err).__name__}: {str(err)[:200]}"
        choice = completion.choices[0]
        parsed = choice.message.parsed
        if not isinstance(parsed, User):
            return False, f"not parsed (finish_reason {choice.finish_reason})"
        return choice.finish_reason == "stop", parsed.model_dump_json()

    return _tally(one, range(n), workers)


def check_completions(client: openai.OpenAI, n: int, workers: int, field: str) -> dict:
    value = REGEX if field == "guided_regex" else CHOICES

    def one(seed: int):
        r = client.completions.create(
            model=MODEL, prompt="The code is", max_tokens=16, temperature=1.0, seed=seed, extra_body={field: value}
        )
        text = r.choices[0].text
        ok = re.fullmatch(REGEX, text) is not None if field == "guided_regex" else text in CHOICES
        return ok, text

    return _tally(one, range(n), workers)


def check_tools(client: openai.OpenAI, n: int, workers: int, stream: bool) -> dict:
    check, _ = validator()
    messages = [{"role": "user", "content": "What is the weather in Oslo, and what time is it in Tokyo?"}]

    def one(seed: int):
        kwargs = dict(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=400,
            temperature=1.0,
            seed=(2000 if stream else 1000) + seed,
        )
        if stream:
            calls: dict[int, dict] = {}
            reason = None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                for tc in choice.delta.tool_calls or []:
                    if tc.index not in calls:
                        if not (
                            tc.id
                            and tc.id.startswith("call_")
                            and tc.type == "function"
                            and tc.function.name
                            and tc.function.arguments == ""
                        ):
                            return False, f"first delta of call {tc.index} is not OpenAI's header: {tc}"
                        calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                    else:
                        calls[tc.index]["arguments"] += tc.function.arguments or ""
                reason = choice.finish_reason or reason
            got = [calls[i] for i in sorted(calls)]
        else:
            r = client.chat.completions.create(**kwargs)
            reason = r.choices[0].finish_reason
            got = [
                {"name": c.function.name, "arguments": c.function.arguments}
                for c in r.choices[0].message.tool_calls or []
            ]
        if reason != "tool_calls" or not got:
            return False, f"finish_reason {reason}, {len(got)} calls"
        problems = [p for c in got if (p := check(c["name"], c["arguments"]))]
        if problems:
            return False, "; ".join(problems)
        calls_made.append(len(got))
        return True, json.dumps(got)

    calls_made: list[int] = []
    result = _tally(one, range(n), workers)
    result["calls_per_response"] = {k: calls_made.count(k) for k in sorted(set(calls_made))}
    return result


def check_bad_input(base_url: str) -> dict:
    """Each bad request is a 400 whose message names the problem, and a good request still answers."""
    msgs = [{"role": "user", "content": "Hi"}]
    cases = {
        "invalid schema": (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}},
                }
            },
            "bogus",
        ),
        "unsupported regex feature": ({"guided_regex": r"(a)\1"}, "backreference"),
        "tool without a name": (
            {"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]},
            "function.name",
        ),
        "tool_choice naming an unknown function": (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}},
            "get_stock",
        ),
        "tool_choice required without tools": ({"tool_choice": "required"}, "needs tools"),
        "invalid parameter schema": (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}},
                        },
                    }
                ]
            },
            "bogus",
        ),
    }
    results, passed = {}, 0
    for label, (extra, needle) in cases.items():
        r = httpx.post(
            base_url + "/chat/completions",
            json={"model": MODEL, "messages": msgs, "max_tokens": 8, **extra},
            timeout=120,
        )
        ok_error = r.status_code == 400 and needle in r.json()["error"]["message"]
        after = httpx.post(
            base_url + "/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 4}, timeout=120
        )
        ok = ok_error and after.status_code == 200
        passed += ok
        results[label] = f"{r.status_code} {r.json()['error']['message'] if r.status_code != 200 else ''}"[:200]
    return {"passed": passed, "total": len(cases), "responses": results}


def _scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("jaxserve:grammar_mask_seconds_total", "jaxserve:grammar_masked_rows_total")):
            out[line.split()[0]] = float(line.split()[1])
        elif line.startswith("jaxserve:steps_total"):
            out["steps"] = out.get("steps", 0.0) + float(line.split()[1])
    return out


def check_throughput(client: openai.OpenAI, base_url: str, batch: int, requests_per_client: int) -> dict:
    messages = [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": "Make up a user profile."},
    ]

    def run(constrained: bool, free_tokens: int = 128) -> dict:
        def one(i: int) -> int:
            if constrained:
                r = client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=400,
                    temperature=1.0,
                    seed=i,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "User", "schema": User.model_json_schema(), "strict": True},
                    },
                )
            else:
                r = client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=free_tokens,
                    temperature=1.0,
                    seed=i,
                    extra_body={"ignore_eos": True},
                )
            return r.usage.completion_tokens

        before = _scrape(base_url)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(batch) as pool:
            tokens = sum(pool.map(one, range(batch * requests_per_client)))
        seconds = time.perf_counter() - start
        after = _scrape(base_url)

        def grew(key: str) -> float:
            return after.get(key, 0.0) - before.get(key, 0.0)

        steps = grew("steps")
        mask = grew("jaxserve:grammar_mask_seconds_total")
        rows = grew("jaxserve:grammar_masked_rows_total")
        return {
            "requests": batch * requests_per_client,
            "output_tokens": tokens,
            "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1),
            "steps": int(steps),
            "mask_us_per_step": round(1e6 * mask / steps, 1) if steps else None,
            "mask_us_per_masked_row": round(1e6 * mask / rows, 1) if rows else None,
        }

    run(True)  # warm: the schema compiled and cached, the buckets touched
    schema = run(True)
    free = run(False, free_tokens=max(1, round(schema["output_tokens"] / schema["requests"])))
    return {
        "batch": batch,
        "free": free,
        "json_schema": schema,
        "ratio": round(schema["tokens_per_s"] / free["tokens_per_s"], 2),
    }


def _tally(fn, items, workers: int) -> dict:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(fn, items))
    passed = sum(ok for ok, _ in results)
    failures = [detail for ok, detail in results if not ok]
    return {
        "passed": passed,
        "total": len(results),
        "seconds": round(time.perf_counter() - start, 1),
        "failures": failures[:5],
        "example": next((d for ok, d in results if ok), None),
    }


# ---- the server -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(args: list[str], timeout: float):
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+b", prefix="check_structured-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "jaxserve.serve", "--host", "127.0.0.1", "--port", str(port), "--no-access-log", *args]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}; log: {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the server was not healthy within {timeout:.0f} s; log: {log.name}")
            time.sleep(0.5)
        yield url + "/v1", " ".join(cmd[1:])
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()


MODEL = None


def main(argv=None) -> int:
    global MODEL
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running server's /v1 base URL (default: start one)")
    ap.add_argument("--server-args", default="", help="extra flags for the started server")
    ap.add_argument("--parse", type=int, default=20)
    ap.add_argument("--guided", type=int, default=200, help="completions per guided field")
    ap.add_argument("--tools", type=int, default=50, help="tool_choice=required requests, streamed and not each")
    ap.add_argument("--workers", type=int, default=8, help="concurrent requests")
    ap.add_argument("--throughput", action="store_true", help="also JSON-schema vs free tokens/s at batch 1 and 16")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--out", help="also write the report here")
    args = ap.parse_args(argv)

    with contextlib.ExitStack() as stack:
        if args.url:
            url, command = args.url, None
        else:
            url, command = stack.enter_context(served(args.server_args.split(), args.startup_timeout))
        client = openai.OpenAI(
            base_url=url, api_key=os.environ.get("JAXSERVE_API_KEY", "none"), timeout=600, max_retries=0
        )
        MODEL = client.models.list().data[0].id
        report = {"server": command or url, "model": MODEL, "openai": openai.__version__, "validator": validator()[1]}
        report["bad_input"] = check_bad_input(url)
        report["parse"] = check_parse(client, args.parse, args.workers)
        for field in ("guided_regex", "guided_choice"):
            report[field] = check_completions(client, args.guided, args.workers, field)
        report["tools_required"] = check_tools(client, args.tools, args.workers, stream=False)
        report["tools_required_stream"] = check_tools(client, args.tools, args.workers, stream=True)
        if args.throughput:
            report["load_average_before"] = os.getloadavg()[0]
            report["throughput"] = [check_throughput(client, url, b, 24 if b == 1 else 6) for b in (1, 16)]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    checks = [v for v in report.values() if isinstance(v, dict) and "passed" in v]
    return 0 if all(c["passed"] == c["total"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
