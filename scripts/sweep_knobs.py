#!/usr/bin/env python3
"""Knob sweep: one engine setting at a time, a fixed workload through scripts/bench_serving.py.

For every value of every knob it starts `python -m jaxserve.serve --config CONFIG --<knob> VALUE` (one
server per value, on a free port), waits for /health, runs bench_serving's workload at each request
rate while scraping the server's /metrics (Prometheus) every --scrape-interval seconds, stops the
server, and records TTFT, TPOT, ITL p99, throughput, KV-cache utilisation, the server's start-up time
and peak resident memory. The config's own values are one shared "baseline" server, which is every
knob's default point. Writes one JSON per server under OUT/points/ (points already there are reused,
so a sweep can be run knob by knob and resumed), then OUT/sweep_knobs.csv and a PNG of output
throughput against p99 TPOT: a curve per knob, a point per value, a panel per request rate.

    python scripts/sweep_knobs.py --out out/sweep_knobs                       # every knob
    python scripts/sweep_knobs.py --out out/sweep_knobs --knobs page_size,quantization
    python scripts/sweep_knobs.py --out out/sweep_knobs --report-only         # CSV + plot from the points
    python scripts/sweep_knobs.py --out out/sweep_knobs -- --num-prompts 64   # after --: bench_serving flags

A knob the server does not accept (not an EngineConfig setting in this checkout) is skipped with a
printed note and a "skipped" row; run it later with --knobs NAME. The workload is bench_serving's:
DEFAULT_WORKLOAD below, then any flags after `--` (later flags win).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import datetime
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from typing import Any, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import httpx  # noqa: E402

import bench_serving  # noqa: E402

DEFAULT_CONFIG = "configs/small.yaml"
DRAFT_MODEL = "checkpoints/small-draft"
# A short, fixed workload: 48 streamed requests, a 64-token prefix shared by all (so prefix caching
# has something to find), 48-144 + 64 prompt tokens, 24-72 output tokens (EOS ignored), two rates.
DEFAULT_WORKLOAD = (
    "--num-prompts",
    "48",
    "--input-len",
    "96",
    "--input-len-range",
    "0.5",
    "--shared-prefix-len",
    "64",
    "--output-len",
    "48",
    "--output-len-range",
    "0.5",
    "--request-rate",
    "4,inf",
    "--warmup",
    "2",
    "--seed",
    "0",
)


@dataclasses.dataclass(frozen=True)
class Knob:
    """One EngineConfig setting swept: its default (the baseline server's) and the other values tried."""

    name: str  # the EngineConfig field (YAML key); the flag is --kebab-case
    default: Any
    values: tuple[Any, ...]  # besides the default
    extra: tuple[str, ...] = ()  # further server flags whenever the value is not the default

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("max_num_seqs", 16, (4, 32)),
        Knob("max_num_batched_tokens", 256, (64, 512)),
        Knob("page_size", 16, (8, 32)),
        Knob("num_scheduler_steps", 1, (4, 8)),
        Knob("enable_prefix_caching", True, (False,)),
        Knob("quantization", "none", ("int8",)),
        Knob("kv_cache_dtype", "auto", ("int8",)),
        Knob("num_speculative_tokens", 0, (4,), extra=("--speculative-model", DRAFT_MODEL)),
    )
}

CSV_COLUMNS = (
    "knob",
    "value",
    "is_default",
    "server_flags",
    "request_rate",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "p50_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "p50_itl_ms",
    "p99_itl_ms",
    "p99_e2el_ms",
    "kv_usage_mean",
    "kv_usage_max",
    "kv_pages_used_max",
    "kv_pages_total",
    "prefix_cache_hit_rate",
    "spec_acceptance_rate",
    "preemptions",
    "server_start_s",
    "server_peak_rss_mib",
    "busy_cores_before",
    "note",
)


def format_value(value: Any) -> str:
    """A knob value as the server's flag parser reads it (booleans as true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def server_flags(knob: Knob, value: Any) -> list[str]:
    """The flags that set `knob` to `value` on `python -m jaxserve.serve` (over the config file)."""
    flags = [knob.flag, format_value(value)]
    if value != knob.default:
        flags += list(knob.extra)
    return flags


def supported_settings() -> set[str]:
    """The EngineConfig settings of this checkout (what `python -m jaxserve.serve` accepts as flags)."""
    from jaxserve.config import EngineConfig

    return set(EngineConfig.field_names())


def point_id(knob: str, value: Any) -> str:
    return "baseline" if knob == "baseline" else f"{knob}={format_value(value)}"


def plan_points(knob_names: Sequence[str], supported: set[str]) -> tuple[list[tuple[str, Any]], list[str]]:
    """(knob, value) servers to run, the baseline first, and notes for the knobs skipped."""
    points: list[tuple[str, Any]] = [("baseline", None)]
    notes = []
    for name in knob_names:
        if name not in KNOBS:
            raise SystemExit(f"error: unknown knob {name!r}; known: {', '.join(KNOBS)}")
        knob = KNOBS[name]
        if name not in supported:
            notes.append(
                f"skipping {name}: this checkout's server does not accept {knob.flag} (not an EngineConfig "
                f"setting yet); re-run later with --knobs {name}"
            )
            continue
        points += [(name, v) for v in knob.values]
    return points, notes


# ---- Prometheus ----------------------------------------------------------------------------------
def parse_prometheus(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition: {name: value} (labelled ones are left out,
    except `_total`/`_sum`/`_count` of unlabelled families, which have no labels either)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        parts = line.split()
        if len(parts) < 2:
            continue
        try:
            values[parts[0]] = float(parts[1])
        except ValueError:
            continue
    return values


def kv_summary(samples: list[dict[str, float]]) -> dict[str, float]:
    """KV-cache figures over the scrapes taken during one run: mean and max of kv_cache_usage_perc
    (tokens stored / slots of the pages in use) over the scrapes with a request running, and the most
    pages in use out of the pool."""
    busy = [s for s in samples if s.get("jaxserve:num_requests_running", 0) > 0] or samples
    usage = [s["jaxserve:kv_cache_usage_perc"] for s in busy if "jaxserve:kv_cache_usage_perc" in s]
    used = [s["jaxserve:kv_pages_used"] for s in samples if "jaxserve:kv_pages_used" in s]
    total = [
        s["jaxserve:kv_pages_used"] + s["jaxserve:kv_pages_free"]
        for s in samples
        if "jaxserve:kv_pages_used" in s and "jaxserve:kv_pages_free" in s
    ]
    nan = float("nan")
    return {
        "kv_usage_mean": sum(usage) / len(usage) if usage else nan,
        "kv_usage_max": max(usage) if usage else nan,
        "kv_pages_used_max": max(used) if used else nan,
        "kv_pages_total": max(total) if total else nan,
    }


def counter(samples: dict[str, float], name: str) -> float:
    """A counter's value whether exposed as NAME or NAME_total."""
    return samples.get(name + "_total", samples.get(name, float("nan")))


# ---- one server ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Server:
    def __init__(self, config: str, flags: list[str], log_path: str, python: str = sys.executable):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            python,
            "-m",
            "jaxserve.serve",
            "--config",
            config,
            "--port",
            str(self.port),
            "--no-access-log",
            "--log-level",
            "warning",
            *flags,
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> float:
        """Start and wait for /health 200; returns seconds to healthy. Raises RuntimeError with the
        log's tail when the server exits or does not get healthy in time."""
        log = open(self.log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(self.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            return bench_serving.wait_for_health(self.url, self.proc, timeout)
        except RuntimeError as err:
            raise RuntimeError(f"{err}: {self.log_tail()}") from None

    def log_tail(self, lines: int = 6) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return " | ".join(line.strip() for line in f.read().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def scrape(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.get(url + "/metrics")
        r.raise_for_status()
        return parse_prometheus(r.text)


def busy_cores(window: float = 2.0) -> float:
    """Cores busy over `window` seconds, from /proc/stat (nan where there is none). Before a run our
    server idles, so this is other people's work on a shared machine."""

    def read() -> tuple[int, int]:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    try:
        total0, idle0 = read()
        time.sleep(window)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return float("nan")
    if total1 == total0:
        return 0.0
    return (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


def wait_for_quiet(max_busy: float, max_wait: float) -> float:
    """Wait (up to max_wait s) until fewer than max_busy cores are busy; returns the last reading."""
    deadline = time.monotonic() + max_wait
    busy = busy_cores()
    if busy > max_busy:
        print(f"     {busy:.1f} cores busy elsewhere: waiting up to {max_wait:.0f} s for < {max_busy:g}", flush=True)
    while busy > max_busy and time.monotonic() < deadline:
        busy = busy_cores(5.0)
    return busy


async def measure(
    url: str, bench_args: argparse.Namespace, interval: float, max_busy: float = float("inf"), max_wait: float = 0.0
) -> list[dict]:
    """bench_serving's workload at each of its rates against `url`, with /metrics scraped meanwhile."""
    rows = []
    for i, rate in enumerate(bench_args.request_rate):
        workload = bench_serving.make_workload(bench_args, run=i)
        busy = await asyncio.to_thread(wait_for_quiet, max_busy, max_wait)
        before = await scrape(url)
        samples: list[dict[str, float]] = []
        done = asyncio.Event()

        async def poll() -> None:
            while not done.is_set():
                try:
                    samples.append(await scrape(url))
                except (httpx.HTTPError, OSError):
                    pass
                try:
                    await asyncio.wait_for(done.wait(), interval)
                except asyncio.TimeoutError:
                    pass

        poller = asyncio.create_task(poll())
        try:
            summary = await bench_serving.run_rate(url, bench_args, rate, workload)
        finally:
            done.set()
            await poller
        after = await scrape(url)
        summary.update(kv_summary(samples))
        summary["prefix_cache_hit_rate"] = after.get("jaxserve:prefix_cache_hit_rate", float("nan"))
        summary["spec_acceptance_rate"] = after.get("jaxserve:spec_decode_acceptance_rate", float("nan"))
        summary["preemptions"] = counter(after, "jaxserve:num_preemptions") - counter(
            before, "jaxserve:num_preemptions"
        )
        summary["metrics_scrapes"] = len(samples)
        summary["busy_cores_before"] = busy
        bench_serving.print_summary(url, summary)
        rows.append(summary)
    return rows


def run_point(knob: str, value: Any, args: argparse.Namespace, bench_args: argparse.Namespace) -> dict:
    flags = [] if knob == "baseline" else server_flags(KNOBS[knob], value)
    pid = point_id(knob, value)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    server = Server(args.config, flags, os.path.join(args.out, "logs", pid + ".log"))
    record: dict[str, Any] = {
        "knob": knob,
        "value": None if value is None else format_value(value),
        "server_flags": " ".join(flags),
        "command": " ".join(server.command[1:]),
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "runs": [],
        "note": "",
    }
    print(f"---- {pid}: {' '.join(server.command[1:])}", flush=True)
    try:
        record["server_start_s"] = server.start(args.server_timeout)
        print(f"     healthy after {record['server_start_s']:.1f} s", flush=True)
        record["runs"] = asyncio.run(
            measure(server.url, bench_args, args.scrape_interval, args.max_busy, args.max_busy_wait)
        )
        record["server_peak_rss_mib"] = peak_rss_mib(server.proc.pid)
    except RuntimeError as err:
        unknown = "unrecognized arguments" in str(err)
        record["note"] = ("skipped: the server does not accept " + flags[0]) if unknown else f"failed: {err}"
        print(f"     {record['note']}", flush=True)
    finally:
        server.stop()
    return record


# ---- report --------------------------------------------------------------------------------------
def rows_from_records(records: dict[str, dict]) -> list[dict]:
    """CSV rows: every knob's default point (the baseline server's runs) and its swept values."""
    rows = []
    base = records.get("baseline")

    def add(knob: str, value: str, is_default: bool, record: dict) -> None:
        runs = record.get("runs") or [{}]
        for run in runs:
            row = {c: run.get(c, "") for c in CSV_COLUMNS}
            row.update(
                knob=knob,
                value=value,
                is_default=int(is_default),
                server_flags=record.get("server_flags", ""),
                server_start_s=record.get("server_start_s", ""),
                server_peak_rss_mib=record.get("server_peak_rss_mib", ""),
                note=record.get("note", ""),
            )
            row["request_rate"] = run.get("request_rate", "")
            rows.append(row)

    if base:
        add("baseline", "", True, base)
    for name, knob in KNOBS.items():
        swept = [r for r in records.values() if r["knob"] == name]
        if not swept:
            continue
        if base:
            add(name, format_value(knob.default), True, base)
        order = {format_value(v): i for i, v in enumerate(knob.values)}
        for record in sorted(swept, key=lambda r: order.get(r["value"], 99)):
            add(name, record["value"], False, record)
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()})


def _float(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def knob_curves(rows: list[dict], rate: str) -> dict[str, list[tuple[str, float, float]]]:
    """{knob: [(value, p99 TPOT ms, output tok/s), ...]} at one request rate, values in sweep order
    with the default first-ordered by the knob's numeric value when it has one."""
    curves: dict[str, list[tuple[str, float, float]]] = {}
    for row in rows:
        if row["knob"] == "baseline" or str(row["request_rate"]) != rate or row["note"]:
            continue
        tpot, tput = _float(row["p99_tpot_ms"]), _float(row["output_throughput"])
        if math.isnan(tpot) or math.isnan(tput):
            continue
        curves.setdefault(row["knob"], []).append((row["value"], tpot, tput))
    for knob, points in curves.items():
        try:
            points.sort(key=lambda p: float(p[0]))
        except ValueError:
            points.sort(key=lambda p: p[0] != format_value(KNOBS[knob].default))
    return curves


def effects_table(rows: list[dict], rate: str = "inf") -> str:
    """Markdown: each knob value's figures at one request rate, and its ratio to the knob's default."""

    def ratio(x: float, base: float) -> str:
        return f" ({x / base:.2f}x)" if base and not math.isnan(x) and not math.isnan(base) else ""

    lines = [
        "| knob | value | output tok/s | TTFT p50 (ms) | TPOT p99 (ms) | ITL p99 (ms) | KV pages used (peak / pool) "
        "| page fill (mean) | peak RSS (MiB) | start (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    defaults = {r["knob"]: r for r in rows if str(r["request_rate"]) == rate and str(r["is_default"]) == "1"}
    for r in rows:
        if r["knob"] == "baseline" or (r["note"] and str(r["request_rate"]) == ""):
            if r["note"]:
                lines.append(f"| {r['knob']} | {r['value']} | {r['note']} |||||||")
            continue
        if str(r["request_rate"]) != rate:
            continue
        d = defaults.get(r["knob"], {})
        f = {
            k: _float(r.get(k))
            for k in (
                "output_throughput",
                "p50_ttft_ms",
                "p99_tpot_ms",
                "p99_itl_ms",
                "kv_pages_used_max",
                "kv_pages_total",
                "kv_usage_mean",
                "server_peak_rss_mib",
                "server_start_s",
            )
        }
        b = {k: _float(d.get(k)) for k in f}
        mark = " (default)" if str(r["is_default"]) == "1" else ""
        lines.append(
            f"| {r['knob']} | {r['value']}{mark} | {f['output_throughput']:.0f}"
            f"{ratio(f['output_throughput'], b['output_throughput']) if not mark else ''} | "
            f"{f['p50_ttft_ms']:.0f}{ratio(f['p50_ttft_ms'], b['p50_ttft_ms']) if not mark else ''} | "
            f"{f['p99_tpot_ms']:.1f}{ratio(f['p99_tpot_ms'], b['p99_tpot_ms']) if not mark else ''} | "
            f"{f['p99_itl_ms']:.0f} | {f['kv_pages_used_max']:.0f} / {f['kv_pages_total']:.0f} | "
            f"{f['kv_usage_mean']:.2f} | {f['server_peak_rss_mib']:.0f} | {f['server_start_s']:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(str(r["request_rate"]) for r in rows if r["request_rate"] != ""))
    fig, axes = plt.subplots(1, max(1, len(rates)), figsize=(7.5 * max(1, len(rates)), 5.5), squeeze=False)
    markers = "osD^v<>PX*"
    for ax, rate in zip(axes[0], rates):
        for i, (knob, points) in enumerate(sorted(knob_curves(rows, rate).items())):
            xs, ys = [p[1] for p in points], [p[2] for p in points]
            ax.plot(xs, ys, marker=markers[i % len(markers)], label=knob)
            for value, x, y in points:
                ax.annotate(value, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        base = [r for r in rows if r["knob"] == "baseline" and str(r["request_rate"]) == rate]
        if base:
            ax.scatter(
                [_float(base[0]["p99_tpot_ms"])],
                [_float(base[0]["output_throughput"])],
                s=160,
                facecolors="none",
                edgecolors="black",
                zorder=5,
                label="baseline (config defaults)",
            )
        ax.set_xlabel("p99 TPOT (ms)")
        ax.set_ylabel("output throughput (tokens/s)")
        ax.set_title(f"request rate {rate} req/s" + (f" - {title}" if title else ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_records(out: str) -> dict[str, dict]:
    records = {}
    folder = os.path.join(out, "points")
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    record = json.load(f)
                records[point_id(record["knob"], record["value"])] = record
    return records


def report(args: argparse.Namespace, skipped: list[str]) -> list[dict]:
    records = load_records(args.out)
    rows = rows_from_records(records)
    for note in skipped:
        knob = note.split()[1].rstrip(":")
        rows.append({**{c: "" for c in CSV_COLUMNS}, "knob": knob, "note": note})
    csv_path = os.path.join(args.out, "sweep_knobs.csv")
    write_csv(rows, csv_path)
    print(f"wrote {csv_path} ({len(rows)} rows)")
    for rate in dict.fromkeys(str(r["request_rate"]) for r in rows if r["request_rate"] != ""):
        print(f"\nrequest rate {rate}:\n" + effects_table(rows, rate))
    if args.plot != "none":
        plot_path = args.plot or os.path.join(args.out, "sweep_knobs.png")
        try:
            plot(rows, plot_path, title=os.path.basename(args.config))
            print(f"wrote {plot_path}")
        except ImportError:
            print("matplotlib is not installed: no plot")
    return rows


# ---- the planner's prediction of each knob on an accelerator ---------------------------------------
@dataclasses.dataclass(frozen=True)
class Scenario:
    """The accelerator workload the predictions assume (roofline lower bounds from jaxserve.planning.roofline)."""

    model: str = "configs/models/llama3-8b"
    dtype: str = "bfloat16"
    context: int = 2048  # tokens each decoding sequence attends to
    prompt_len: int = 1024  # the prompt whose time to first token is bounded
    shared_prefix: int = 512  # of it, what a prefix-cache hit skips
    acceptance: float = 0.6  # draft acceptance rate per token, for speculation
    draft_cost: float = 0.1  # one draft step's time / one target decode step's


def predict(device: str, num_devices: int, scenario: Scenario = Scenario()) -> list[dict]:
    """Each knob value's roofline bounds on `num_devices` x `device` (a model axis over all of them):
    TTFT >= prefill of the prompt in max_num_batched_tokens chunks; TPOT >= one decode step of
    max_num_seqs sequences at `context` (plus, for a chunk size, the stall one chunk step puts
    between decode steps); decode tokens/s <=; memory per device; sequences of `context` that fit;
    and the KV slots a sequence wastes in its last page on average, (page_size - 1) / 2. Speculation:
    TPOT >= (verify step + k draft steps) / expected tokens per verify step, (1 - a^(k+1)) / (1 - a).
    Knobs the roofline does not see (scheduler steps) get no figures."""
    from jaxserve.planning import roofline as P
    from jaxserve.config import ModelConfig
    from jaxserve.planning.devices import get_device

    cfg = ModelConfig.from_dir(os.path.join(REPO, scenario.model))
    target = P.Target.build(get_device(device), (1, num_devices))
    b = P.DTYPE_BYTES[scenario.dtype]
    base = {k.name: k.default for k in KNOBS.values()}

    def bounds(**over: Any) -> dict:
        v = {**base, **over}
        plan = P.make_plan(
            cfg,
            target,
            dtype=scenario.dtype,
            quantization=v["quantization"],
            kv_cache_dtype=v["kv_cache_dtype"],
            page_size=v["page_size"],
            context=scenario.context,
            batch=v["max_num_seqs"],
            batch_is_required=False,
        )
        params, kv = plan.param_bytes_per_device, plan.kv_bytes_per_token_per_device
        batch, chunk = v["max_num_seqs"], v["max_num_batched_tokens"]
        decode = P.decode_bound(cfg, target, params, kv, batch, scenario.context, b)
        chunk_step = P.prefill_bound(cfg, target, params, kv, chunk, b)
        uncached = scenario.prompt_len - (scenario.shared_prefix if v["enable_prefix_caching"] else 0)
        ttft = math.ceil(uncached / chunk) * chunk_step.seconds
        tpot, tokens_per_s = decode.seconds, decode.tokens_per_s
        k = v["num_speculative_tokens"]
        if k:  # a verify step reads what a decode step reads and multiplies k+1 tokens per sequence
            a = scenario.acceptance
            n = batch * (k + 1)
            flops = P.matmul_flops(P.matmul_params(cfg), n) + P.attention_flops(
                cfg.num_heads, cfg.head_dim, cfg.num_layers, n, scenario.context
            )
            verify = P.step_seconds(
                decode.memory_s,
                P.compute_bound_seconds(flops / num_devices, target.peak_flops),
                P.tp_allreduce_seconds(n, cfg.hidden_size, b, cfg.num_layers, num_devices, target.allreduce_bandwidth),
            )
            per_step = (1 - a ** (k + 1)) / (1 - a)  # expected tokens per verify step
            tpot = (verify + k * scenario.draft_cost * decode.seconds) / per_step
            tokens_per_s = batch / tpot
        return {
            "ttft_ms": ttft * 1e3,
            "tpot_ms": tpot * 1e3,
            "decode_tok_s": tokens_per_s,
            "chunk_stall_ms": chunk_step.seconds * 1e3,
            "memory_gib": (params + batch * scenario.context * kv) / 2**30,
            "max_seqs": plan.max_batch,
            "page_waste_tokens": (v["page_size"] - 1) / 2,
            "fits": plan.max_batch >= 1,
        }

    default = bounds()
    rows = [{"knob": "baseline", "value": "", **default}]
    for knob in KNOBS.values():
        for value in (knob.default, *knob.values):
            row = bounds(**{knob.name: value}) if knob.name != "num_scheduler_steps" else dict(default)
            rows.append({"knob": knob.name, "value": format_value(value), **row})
    return rows


def format_predictions(device: str, num_devices: int, scenario: Scenario = Scenario()) -> str:
    rows = predict(device, num_devices, scenario)
    base = rows[0]
    lines = [
        f"### {num_devices} x {device}: {scenario.model}, {scenario.dtype}, context {scenario.context}, "
        f"{scenario.prompt_len}-token prompt ({scenario.shared_prefix} shared), speculation acceptance "
        f"{scenario.acceptance:g} with a draft step at {scenario.draft_cost:g} of a target step",
        "",
        "| knob | value | TTFT >= (ms) | TPOT >= (ms) | decode tok/s <= | one chunk stalls decode (ms) | "
        "memory/device (GiB) | seqs that fit | page waste (tokens/seq) | vs default: TTFT / TPOT / tok/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows[1:]:
        if r["knob"] == "num_scheduler_steps":
            lines.append(
                f"| {r['knob']} | {r['value']} | - | - | - | - | - | - | - | host overhead only: not in the roofline |"
            )
            continue
        rel = (
            f"{r['ttft_ms'] / base['ttft_ms']:.2f}x / {r['tpot_ms'] / base['tpot_ms']:.2f}x / "
            f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x"
        )
        lines.append(
            f"| {r['knob']} | {r['value']} | {r['ttft_ms']:.2f} | {r['tpot_ms']:.2f} | "
            f"{r['decode_tok_s']:,.0f} | {r['chunk_stall_ms']:.2f} | {r['memory_gib']:.2f} | "
            f"{r['max_seqs']:,} | {r['page_waste_tokens']:.1f} | {rel} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Flags after -- go to bench_serving.py.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the servers' settings YAML (the baseline)")
    p.add_argument("--knobs", default=",".join(KNOBS), help="comma list of knobs to sweep")
    p.add_argument("--out", default="out/sweep_knobs", help="folder for points/, logs/, the CSV and the plot")
    p.add_argument("--plot", default=None, help="PNG path (default OUT/sweep_knobs.png; 'none' for no plot)")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds a server may take to get healthy")
    p.add_argument("--scrape-interval", type=float, default=0.5, help="seconds between /metrics scrapes")
    p.add_argument(
        "--max-busy",
        type=float,
        default=0.7,
        help="before each run wait until fewer cores than this are busy (others' work on a shared machine)",
    )
    p.add_argument("--max-busy-wait", type=float, default=30.0, help="most seconds to wait for that")
    p.add_argument("--force", action="store_true", help="re-run points already recorded under OUT/points")
    p.add_argument("--report-only", action="store_true", help="only rebuild the CSV and plot from OUT/points")
    p.add_argument("--dry-run", action="store_true", help="print the servers that would run, and exit")
    p.add_argument(
        "--predict",
        default=None,
        metavar="DEVICE[:N],...",
        help="print the planner's predicted effect of each knob on these devices (e.g. h100,tpu-v5e:4: "
        "N devices on the model axis) as Markdown, and exit; runs no server",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, bench = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(own)
    if args.predict:
        for item in args.predict.split(","):
            device, _, n = item.strip().partition(":")
            print(format_predictions(device, int(n or 1)) + "\n")
        return 0
    bench_args = bench_serving.build_parser().parse_args([*DEFAULT_WORKLOAD, *bench])
    knob_names = [k.strip() for k in args.knobs.split(",") if k.strip()]
    points, skipped = plan_points(knob_names, supported_settings())
    for note in skipped:
        print(f"NOTE: {note}", flush=True)
    os.makedirs(os.path.join(args.out, "points"), exist_ok=True)
    if args.dry_run:
        for knob, value in points:
            print(point_id(knob, value), " ".join([] if knob == "baseline" else server_flags(KNOBS[knob], value)))
        return 0
    if not args.report_only:
        meta = {
            "config": args.config,
            "workload": [*DEFAULT_WORKLOAD, *bench],
            "host": platform.node(),
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "argv": ["scripts/sweep_knobs.py", *argv],
        }
        with open(os.path.join(args.out, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        for knob, value in points:
            path = os.path.join(args.out, "points", point_id(knob, value) + ".json")
            if os.path.exists(path) and not args.force:
                with open(path, encoding="utf-8") as f:
                    recorded = json.load(f).get("runs")
                if recorded:  # a failed point is tried again
                    print(f"---- {point_id(knob, value)}: already recorded in {path}")
                    continue
            start = time.perf_counter()
            record = run_point(knob, value, args, bench_args)
            record["wall_s"] = time.perf_counter() - start
            record["workload"] = [*DEFAULT_WORKLOAD, *bench]
            if not record["runs"] and record["note"].startswith("skipped"):
                skipped.append(f"skipping {knob}: {record['note']}")
                continue  # not recorded, so a later run tries it again
            with open(path, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=2, default=str)
    report(args, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
