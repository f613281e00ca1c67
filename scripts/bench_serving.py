#!/usr/bin/env python3
"""Serving benchmark: a load generator against any OpenAI-compatible server (in the style of vLLM's).

Seeded synthetic prompts with chosen input and output length distributions (optionally all sharing a
fixed prefix), sent with Poisson arrivals at --request-rate (or all at once with `inf`), at most
--max-concurrency in flight, every request streamed. Reports request throughput, output and total
token throughput, TTFT, TPOT (time per output token after the first), ITL (inter-token latency,
between streamed chunks) and end-to-end latency at mean/p50/p90/p99, and goodput (requests/s that
meet every given --slo-ttft/--slo-tpot, in ms), and with --cost-per-hour (USD per device-hour, times
--num-devices) the cost per million input and per million output tokens at the measured throughput.
`python -m jaxserve.plan capacity OUT.json --target-rate R` turns the goodput into replicas. Writes JSON; with --plot, a PNG of latency against
request rate over the swept rates (--request-rate 1,2,4,inf), one line per server (--base-url may be
repeated, with a --label each, e.g. continuous vs static batching).

Examples:
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --input-len 128 --output-len 128 --request-rate 1,2,4,8,inf --result-json out.json --plot out.png
    python scripts/bench_serving.py --shared-prefix-len 512 --input-len 64 --output-len 32 ...

Prompts are token ids on /v1/completions by default (exact lengths, no tokenizer needed; ids drawn
from [--token-id-low, --token-id-high)); `--prompt-format text` sends words instead, and
/v1/chat/completions always sends text. Output lengths are exact unless --no-ignore-eos.
Each rate of a sweep (and each warm-up) gets its own prompts of the same lengths: a rate run after
another on one server would otherwise find every prompt in its prefix cache, and measure a cached
prompt's TTFT. Only --shared-prefix-len is shared, on purpose.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # jaxserve.planning, for costs

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact water room mother area money story month lot right study "
         "book job word business issue side kind head house service friend father power hour game line end member "
         "law car city community name president team minute idea kid body information back parent face others level "
         "office door health art war history party result change morning reason research girl guy moment air "
         "teacher force education").split()


# ---- workload ------------------------------------------------------------------------------------


@dataclass
class Request:
    index: int
    prompt: Any  # list[int] or str
    input_len: int
    output_len: int


def _lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    lo = max(1, int(round(mean * (1 - range_ratio))))
    hi = max(lo, int(round(mean * (1 + range_ratio))))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_workload(args: argparse.Namespace, run: int | str = 0) -> list[Request]:
    """The seeded requests of one run. Every run has the same lengths and shared prefix; each `run`
    (a sweep's rate index, a warm-up) draws its own prompt bodies, so that a run after the first does
    not hit the prefix cache on the prompts sent before it. Run 0 is the workload of earlier versions."""
    rng = random.Random(args.seed)
    inputs = _lengths(rng, args.input_len, args.input_len_range, args.num_prompts)
    outputs = _lengths(rng, args.output_len, args.output_len_range, args.num_prompts)
    text = args.prompt_format == "text" or args.endpoint.endswith("chat/completions")
    lo, hi = args.token_id_low, args.token_id_high

    def make(n: int, rng: random.Random):
        if text:
            return " ".join(rng.choice(WORDS) for _ in range(n))
        return [rng.randrange(lo, hi) for _ in range(n)]

    prefix = make(args.shared_prefix_len, rng) if args.shared_prefix_len else ([] if not text else "")
    bodies = rng if run == 0 else random.Random(f"{args.seed}/{run}")
    requests = []
    for i, (n_in, n_out) in enumerate(zip(inputs, outputs)):
        body = make(n_in, bodies)
        if text:
            prompt = (prefix + " " + body).strip() if prefix else body
        else:
            prompt = list(prefix) + body
        requests.append(Request(i, prompt, args.shared_prefix_len + n_in, n_out))
    return requests


# ---- one request ---------------------------------------------------------------------------------


@dataclass
class Result:
    index: int
    ok: bool = False
    error: str = ""
    input_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


async def send(client: httpx.AsyncClient, args: argparse.Namespace, model: str, req: Request) -> Result:
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    result = Result(req.index, input_len=req.input_len)
    start = time.perf_counter()
    result.start = start
    last = None
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", args.endpoint, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    result.error = str(data["error"].get("message"))
                    return result
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens")
                if not data.get("choices"):
                    continue
                c = data["choices"][0]
                delta = c.get("delta") or {}
                if delta.get("role") and not delta.get("content") and not c.get("finish_reason"):
                    continue  # chat's opening role chunk carries no token
                # Otherwise a chunk means new tokens (their text may be empty: a server without a tokenizer).
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.e2el = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = last is not None
    if not result.ok:
        result.error = "no tokens received"
    return result


# ---- one run at one rate -------------------------------------------------------------------------


def wait_for_health(base_url: str, proc: Any, timeout: float) -> float:
    """Poll `base_url`/health until it answers 200 (a server this process started as `proc`, a
    subprocess.Popen); returns the seconds it took. Raises RuntimeError if the process exits first or
    the server is not healthy within `timeout` seconds (callers add where its log is)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not healthy after {timeout:.0f} s")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    f, c = math.floor(k), math.ceil(k)
    return s[f] + (s[c] - s[f]) * (k - f)


def summarize(results: list[Result], duration: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    series = {
        "ttft_ms": [r.ttft * 1e3 for r in ok],
        "tpot_ms": [r.tpot * 1e3 for r in ok if r.tpot is not None],
        "itl_ms": [x * 1e3 for r in ok for x in r.itl],
        "e2el_ms": [r.e2el * 1e3 for r in ok],
    }
    for name, values in series.items():
        summary[f"mean_{name}"] = sum(values) / len(values) if values else float("nan")
        for q in (50, 90, 99):
            summary[f"p{q}_{name}"] = _pct(values, q)
    if args.slo_ttft is not None or args.slo_tpot is not None:
        good = 0
        for r in ok:
            if args.slo_ttft is not None and r.ttft * 1e3 > args.slo_ttft:
                continue
            if args.slo_tpot is not None and r.tpot is not None and r.tpot * 1e3 > args.slo_tpot:
                continue
            good += 1
        summary["goodput"] = good / duration if duration else 0.0
        summary["slo_attainment"] = good / len(results) if results else 0.0
    cost = getattr(args, "cost_per_hour", None)
    if cost is not None:
        summary.update(token_costs(summary, cost, getattr(args, "num_devices", 1) or 1))
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:10]
    return summary


def token_costs(summary: dict, cost_per_device_hour: float, num_devices: int = 1) -> dict:
    """USD per million input, output and all tokens at the run's measured token throughputs (jaxserve.planning.roofline's
    cost_per_million_tokens: cost_per_device_hour · num_devices / 3600 / tokens_per_s · 10⁶). Each
    charges the whole cost to that kind of token; None where the run moved no such tokens."""
    from jaxserve.planning.roofline import cost_per_million_tokens

    duration = summary.get("duration_s") or 0.0

    def per_million(tokens: float) -> float | None:
        if not duration or not tokens:
            return None
        return cost_per_million_tokens(cost_per_device_hour, num_devices, tokens / duration)

    inputs, outputs = summary.get("total_input_tokens", 0), summary.get("total_output_tokens", 0)
    return {"cost_per_hour": cost_per_device_hour * num_devices, "num_devices": num_devices,
            "usd_per_million_input_tokens": per_million(inputs),
            "usd_per_million_output_tokens": per_million(outputs),
            "usd_per_million_tokens": per_million(inputs + outputs)}


async def step_metrics(client: httpx.AsyncClient) -> dict | None:
    """The server's step composition from /metrics (jaxserve's steps_total{kind} and iteration_tokens
    histogram); None for a server without them (another engine)."""
    try:
        r = await client.get("/metrics")
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    kinds, buckets, total, cpu, joined = {}, {}, None, None, None
    for line in r.text.splitlines():
        if line.startswith("jaxserve:steps_total{"):
            kinds[line.split('kind="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("jaxserve:iteration_tokens_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(le)] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("jaxserve:iteration_tokens_sum "):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("jaxserve:arrivals_joined_total "):
            joined = float(line.rsplit(" ", 1)[1])
        elif line.startswith("process_cpu_seconds_total "):  # the server process: host and XLA threads
            cpu = float(line.rsplit(" ", 1)[1])
    return {"steps": kinds, "buckets": buckets, "tokens": total, "cpu_seconds": cpu, "arrivals_joined": joined} \
        if kinds else None


def step_composition(before: dict | None, after: dict | None) -> dict:
    """Steps by kind during a run, and the share of token slots that were real tokens: a step's token
    axis is padded to its token bucket, which is the iteration_tokens bucket it lands in (jaxserve's
    histogram bounds are its step buckets; one replica), so the slots are the sum of each bucket's new
    steps times its bound."""
    if before is None or after is None:
        return {}
    steps = {k: after["steps"].get(k, 0) - before["steps"].get(k, 0) for k in after["steps"]}
    bounds = sorted(after["buckets"])
    slots, below = 0.0, 0.0
    for bound in bounds:
        cumulative = after["buckets"][bound] - before["buckets"].get(bound, 0)
        if math.isfinite(bound):
            slots += (cumulative - below) * bound
        below = cumulative
    tokens = after["tokens"] - before["tokens"]

    def change(key):  # a counter's increase over the run; None where the server lacks it
        return None if before.get(key) is None or after.get(key) is None else after[key] - before[key]

    return {"steps_by_kind": steps, "step_tokens": tokens, "step_token_slots": slots,
            "token_slot_fill": tokens / slots if slots else None, "server_cpu_seconds": change("cpu_seconds"),
            # requests that joined a step held back for them (async scheduling)
            "arrivals_joined": change("arrivals_joined")}


async def run_rate(base_url: str, args: argparse.Namespace, rate: float, workload: list[Request]) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or len(workload)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        for req in make_workload(args, run=f"warm-up at {rate}")[: args.warmup]:  # not the measured prompts
            await send(client, args, model, req)
        rng = random.Random(args.seed + 1)
        sem = asyncio.Semaphore(limit)

        async def limited(req: Request) -> Result:
            async with sem:
                return await send(client, args, model, req)

        metrics_before = await step_metrics(client)
        tasks = []
        start = time.perf_counter()
        for req in workload:
            tasks.append(asyncio.create_task(limited(req)))
            if math.isfinite(rate) and rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        composition = step_composition(metrics_before, await step_metrics(client))
    summary = summarize(list(results), duration, args)
    summary.update(composition)
    if composition.get("server_cpu_seconds") is not None and summary.get("total_output_tokens"):
        summary["server_cpu_seconds_per_output_token"] = composition["server_cpu_seconds"] / summary["total_output_tokens"]
    summary.update({"request_rate": rate if math.isfinite(rate) else "inf", "base_url": base_url, "model": model,
                    "max_concurrency": args.max_concurrency})
    if args.save_requests:
        summary["requests"] = [asdict(r) for r in results]
    return summary


def print_summary(label: str, s: dict) -> None:
    print(f"==== {label}  rate={s['request_rate']}  concurrency={s['max_concurrency']} ====")
    print(f"  completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f} s")
    print(f"  request throughput {s['request_throughput']:.2f} req/s   output {s['output_throughput']:.1f} tok/s   "
          f"total {s['total_token_throughput']:.1f} tok/s")
    for name in ("ttft", "tpot", "itl", "e2el"):
        print(f"  {name.upper():5s} ms  mean {s[f'mean_{name}_ms']:9.2f}  p50 {s[f'p50_{name}_ms']:9.2f}  "
              f"p90 {s[f'p90_{name}_ms']:9.2f}  p99 {s[f'p99_{name}_ms']:9.2f}")
    if "goodput" in s:
        print(f"  goodput {s['goodput']:.2f} req/s  (SLO attainment {100 * s['slo_attainment']:.1f}%)")
    if s.get("cost_per_hour") is not None:
        def usd(x):
            return "n/a" if x is None else f"${x:.4f}"
        print(f"  cost ${s['cost_per_hour']:.2f}/hour ({s['num_devices']} device(s)): "
              f"{usd(s['usd_per_million_input_tokens'])} per M input tokens, "
              f"{usd(s['usd_per_million_output_tokens'])} per M output tokens, "
              f"{usd(s['usd_per_million_tokens'])} per M tokens of both")
    if s.get("steps_by_kind"):
        fill = s["token_slot_fill"]
        print(f"  steps {s['steps_by_kind']}  real tokens in "
              f"{'n/a' if fill is None else f'{100 * fill:.0f}%'} of the token slots"
              + ("" if s.get("arrivals_joined") is None
                 else f"; {s['arrivals_joined']:.0f} arrivals joined a held step"))
    if s.get("server_cpu_seconds_per_output_token") is not None:
        print(f"  server CPU {1e3 * s['server_cpu_seconds_per_output_token']:.2f} ms per output token "
              f"({s['server_cpu_seconds']:.1f} s, all threads)")
    for err in s.get("errors", []):
        print(f"  error: {err}")


def plot(runs: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("e2el", "end-to-end latency (ms)"))
    for label, summaries in runs.items():
        rates = [s["request_rate"] for s in summaries]
        finite = [r for r in rates if r != "inf"]
        inf_x = (max(finite) * 2 if finite else 1.0)
        xs = [inf_x if r == "inf" else r for r in rates]
        for ax, (name, title) in zip(axes, panels):
            ax.plot(xs, [s[f"p50_{name}_ms"] for s in summaries], marker="o", label=f"{label} p50")
            ax.plot(xs, [s[f"p99_{name}_ms"] for s in summaries], marker="x", linestyle="--", label=f"{label} p99")
            ax.set_title(title)
            ax.set_xlabel("request rate (req/s; rightmost = inf)" if "inf" in rates else "request rate (req/s)")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            rates.append(float("inf") if part == "inf" else float(part))
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("request rates must be positive numbers or 'inf'")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", action="append", default=None,
                   help="server URL (repeat to compare servers); default http://127.0.0.1:8000")
    p.add_argument("--label", action="append", default=None, help="a name per --base-url for the report and plot")
    p.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--model", default=None, help="model name; default: the first of GET /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128, help="mean prompt length (tokens, or words for text)")
    p.add_argument("--input-len-range", type=float, default=0.0, help="lengths uniform in mean*(1 +- this)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--output-len-range", type=float, default=0.0)
    p.add_argument("--shared-prefix-len", type=int, default=0, help="a fixed prefix of this length on every prompt")
    p.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    p.add_argument("--token-id-low", type=int, default=10)
    p.add_argument("--token-id-high", type=int, default=250)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (lengths then vary)")
    p.add_argument("--request-rate", type=parse_rates, default=[float("inf")],
                   help="requests/s of the Poisson arrivals, or inf; a comma list sweeps the rates")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--warmup", type=int, default=0, help="requests sent one by one before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    p.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO on TTFT, ms")
    p.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO on TPOT, ms")
    p.add_argument("--cost-per-hour", type=float, default=None,
                   help="USD per device-hour: report cost per million input / output tokens at the measured throughput")
    p.add_argument("--num-devices", type=int, default=1, help="devices the server uses (for --cost-per-hour)")
    p.add_argument("--result-json", default=None, help="write every run's summary here")
    p.add_argument("--save-requests", action="store_true", help="include per-request records in the JSON")
    p.add_argument("--plot", default=None, help="write a PNG of latency against request rate")
    return p


async def amain(args: argparse.Namespace) -> dict:
    urls = args.base_url or ["http://127.0.0.1:8000"]
    labels = args.label or ([] if len(urls) > 1 else ["server"])
    if len(labels) < len(urls):
        labels = labels + [f"server{i}" for i in range(len(labels), len(urls))]
    workloads = [make_workload(args, run=i) for i in range(len(args.request_rate))]  # the same for every server
    runs: dict[str, list[dict]] = {}
    for url, label in zip(urls, labels):
        runs[label] = []
        for rate, workload in zip(args.request_rate, workloads):
            summary = await run_rate(url.rstrip("/"), args, rate, workload)
            summary["label"] = label
            print_summary(label, summary)
            runs[label].append(summary)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    config["request_rate"] = ["inf" if not math.isfinite(r) else r for r in args.request_rate]
    report = {"config": config, "runs": runs}
    if args.result_json:
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, default=str)
    if args.plot:
        plot(runs, args.plot)
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = asyncio.run(amain(args))
    failed = sum(s["failed"] for summaries in report["runs"].values() for s in summaries)
    return 1 if failed and all(s["completed"] == 0 for v in report["runs"].values() for s in v) else 0


if __name__ == "__main__":
    sys.exit(main())
