#!/usr/bin/env python3
"""Serving benchmark sweeps: `jaxserve bench serve`'s load generator (jaxserve/bench) over several rates and servers.

For one run against one server, `jaxserve bench serve` (docs/bench.md) is the command; this script
keeps what the studies in docs/BENCHMARKS.md use around the same load generator: a sweep of rates,
several servers, a plot, costs and jaxserve's step composition from /metrics.

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
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # jaxserve, from a checkout

from jaxserve.bench import metrics as bench_metrics  # noqa: E402
from jaxserve.bench.datasets import WORDS, SampleRequest, random_requests  # noqa: E402,F401
from jaxserve.bench.http import Client, HTTPError  # noqa: E402
from jaxserve.bench.loadgen import first_model, run_load  # noqa: E402

# The request and result records are the package's (`jaxserve bench serve`); the names are this script's.
Request = SampleRequest
Result = bench_metrics.RequestResult
_pct = bench_metrics.percentile


# ---- workload ------------------------------------------------------------------------------------


def make_workload(args: argparse.Namespace, run: int | str = 0) -> list[Request]:
    """The seeded requests of one run (jaxserve.bench.datasets.random_requests). Every run has the same
    lengths and shared prefix; each `run` (a sweep's rate index, a warm-up) draws its own prompt bodies,
    so that a run after the first does not hit the prefix cache on the prompts sent before it."""
    text = args.prompt_format == "text" or args.endpoint.endswith("chat/completions")
    return random_requests(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.input_len_range,
        args.shared_prefix_len,
        args.seed,
        run,
        text=text,
        token_low=args.token_id_low,
        token_high=args.token_id_high,
        output_range_ratio=args.output_len_range,
    )


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


def summarize(results: list[Result], duration: float, args: argparse.Namespace) -> dict:
    """jaxserve.bench.metrics.summarize at mean/p50/p90/p99 of TTFT, TPOT, ITL and E2EL, under this
    script's names too (duration_s; goodput and slo_attainment with --slo-ttft/--slo-tpot), plus costs."""
    slo = {k: v for k, v in (("ttft", args.slo_ttft), ("tpot", args.slo_tpot)) if v is not None}
    summary = bench_metrics.summarize(results, duration, (50, 90, 99), bench_metrics.METRICS, slo or None)
    summary["duration_s"] = duration
    if slo:
        summary["goodput"] = summary["request_goodput"]
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
    return {
        "cost_per_hour": cost_per_device_hour * num_devices,
        "num_devices": num_devices,
        "usd_per_million_input_tokens": per_million(inputs),
        "usd_per_million_output_tokens": per_million(outputs),
        "usd_per_million_tokens": per_million(inputs + outputs),
    }


async def step_metrics(client: Client) -> dict | None:
    """The server's step composition from /metrics (jaxserve's steps_total{kind} and iteration_tokens
    histogram); None for a server without them (another engine)."""
    try:
        status, body = await client.get("/metrics")
    except (HTTPError, OSError, asyncio.IncompleteReadError):
        return None
    if status != 200:
        return None
    text = body.decode(errors="replace")
    kinds, buckets, total, cpu, joined = {}, {}, None, None, None
    for line in text.splitlines():
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
    return (
        {"steps": kinds, "buckets": buckets, "tokens": total, "cpu_seconds": cpu, "arrivals_joined": joined}
        if kinds
        else None
    )


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

    return {
        "steps_by_kind": steps,
        "step_tokens": tokens,
        "step_token_slots": slots,
        "token_slot_fill": tokens / slots if slots else None,
        "server_cpu_seconds": change("cpu_seconds"),
        # requests that joined a step held back for them (async scheduling)
        "arrivals_joined": change("arrivals_joined"),
    }


async def run_rate(base_url: str, args: argparse.Namespace, rate: float, workload: list[Request]) -> dict:
    """One run of `workload` at `rate` through jaxserve.bench's load generator, with the server's step
    composition (/metrics) before and after."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    options = dict(ignore_eos=not args.no_ignore_eos, temperature=args.temperature, timeout=args.timeout)
    async with Client(base_url, headers, timeout=args.timeout) as client:
        model = args.model or await first_model(client)
        warm = make_workload(args, run=f"warm-up at {rate}")[: args.warmup]  # not the measured prompts
        if warm:
            await run_load(client, warm, args.endpoint, model, float("inf"), max_concurrency=1, **options)
        metrics_before = await step_metrics(client)
        results, duration = await run_load(
            client,
            workload,
            args.endpoint,
            model,
            rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed + 1,
            **options,
        )
        composition = step_composition(metrics_before, await step_metrics(client))
    summary = summarize(list(results), duration, args)
    summary.update(composition)
    if composition.get("server_cpu_seconds") is not None and summary.get("total_output_tokens"):
        summary["server_cpu_seconds_per_output_token"] = (
            composition["server_cpu_seconds"] / summary["total_output_tokens"]
        )
    summary.update(
        {
            "request_rate": rate if math.isfinite(rate) else "inf",
            "base_url": base_url,
            "model": model,
            "max_concurrency": args.max_concurrency,
        }
    )
    if args.save_requests:
        summary["requests"] = [asdict(r) for r in results]
    return summary


def print_summary(label: str, s: dict) -> None:
    print(f"==== {label}  rate={s['request_rate']}  concurrency={s['max_concurrency']} ====")
    print(f"  completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f} s")
    print(
        f"  request throughput {s['request_throughput']:.2f} req/s   output {s['output_throughput']:.1f} tok/s   "
        f"total {s['total_token_throughput']:.1f} tok/s"
    )
    for name in ("ttft", "tpot", "itl", "e2el"):
        print(
            f"  {name.upper():5s} ms  mean {s[f'mean_{name}_ms']:9.2f}  p50 {s[f'p50_{name}_ms']:9.2f}  "
            f"p90 {s[f'p90_{name}_ms']:9.2f}  p99 {s[f'p99_{name}_ms']:9.2f}"
        )
    if "goodput" in s:
        print(f"  goodput {s['goodput']:.2f} req/s  (SLO attainment {100 * s['slo_attainment']:.1f}%)")
    if s.get("cost_per_hour") is not None:

        def usd(x):
            return "n/a" if x is None else f"${x:.4f}"

        print(
            f"  cost ${s['cost_per_hour']:.2f}/hour ({s['num_devices']} device(s)): "
            f"{usd(s['usd_per_million_input_tokens'])} per M input tokens, "
            f"{usd(s['usd_per_million_output_tokens'])} per M output tokens, "
            f"{usd(s['usd_per_million_tokens'])} per M tokens of both"
        )
    if s.get("steps_by_kind"):
        fill = s["token_slot_fill"]
        print(
            f"  steps {s['steps_by_kind']}  real tokens in "
            f"{'n/a' if fill is None else f'{100 * fill:.0f}%'} of the token slots"
            + ("" if s.get("arrivals_joined") is None else f"; {s['arrivals_joined']:.0f} arrivals joined a held step")
        )
    if s.get("server_cpu_seconds_per_output_token") is not None:
        print(
            f"  server CPU {1e3 * s['server_cpu_seconds_per_output_token']:.2f} ms per output token "
            f"({s['server_cpu_seconds']:.1f} s, all threads)"
        )
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
        inf_x = max(finite) * 2 if finite else 1.0
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
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--base-url",
        action="append",
        default=None,
        help="server URL (repeat to compare servers); default http://127.0.0.1:8000",
    )
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
    p.add_argument(
        "--request-rate",
        type=parse_rates,
        default=[float("inf")],
        help="requests/s of the Poisson arrivals, or inf; a comma list sweeps the rates",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--warmup", type=int, default=0, help="requests sent one by one before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    p.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO on TTFT, ms")
    p.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO on TPOT, ms")
    p.add_argument(
        "--cost-per-hour",
        type=float,
        default=None,
        help="USD per device-hour: report cost per million input / output tokens at the measured throughput",
    )
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
