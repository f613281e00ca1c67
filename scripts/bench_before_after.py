#!/usr/bin/env python
"""Before/after speed of a refactor: two source trees benchmarked alternately in one run, one CPU.

Each round runs, as subprocesses of each tree (its directory the working directory and first on
PYTHONPATH, the same interpreter), in the order before, after (even rounds) or after, before (odd
rounds: B A A B ..., so that a linear drift of the machine hits both sides alike):

* host   the tree's own scripts/bench_host_overhead.py with the same arguments (default: the shipped
         small model, where host time weighs most, batches 1 and 16 at context 128, async scheduling
         off and on): engine decode tokens/s through `LLMEngine.step` (higher is better) and host
         microseconds per step, the step less dispatch and wait (lower is better), per point;
* decode the real default model (SmolLM2-135M-Instruct, configs/default.yaml, float32) through the
         public API only (`LLM`, `SamplingParams`, `generate`), greedy with EOS ignored: batch 1 and
         batch 16 prompts of 16 tokens generating --new-tokens each; decode tokens/s = the tokens after
         each row's first / (last finish - first first token), after one untimed warm-up generate,
         the median of --repeats generates.

For each metric: each side's median over the rounds and its run-to-run spread (min..max), and the
verdict: "ok" when the after median is within the before spread or better, "SLOWER" otherwise (with
one round the spread is a single value: any loss reads SLOWER).

    python scripts/bench_before_after.py --before /tmp/baseline --after . --json out/before_after.json
    python scripts/bench_before_after.py --before /tmp/baseline --after . --rounds 1 --quick   # checks it runs
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HOST_ARGS = "--models small --batches 1,16 --contexts 128"
HOST_ARGS_QUICK = "--quick --rounds 1 --contexts 64"  # the tiny dummy model, batches 1 and 2

# Run in the tree's directory with the tree first on PYTHONPATH; argv: new_tokens repeats batches.
DECODE_SNIPPET = r"""
import json, statistics, sys
import numpy as np, yaml
import jaxserve
from jaxserve import LLM, SamplingParams
new_tokens, repeats, batches = int(sys.argv[1]), int(sys.argv[2]), [int(b) for b in sys.argv[3].split(",")]
with open("configs/default.yaml", encoding="utf-8") as f:
    settings = yaml.safe_load(f)
settings.update(dtype="float32", max_num_seqs=max(max(batches), settings.get("max_num_seqs", 1)))
with LLM(**settings) as llm:
    prompts = np.random.default_rng(0).integers(1000, 20000, (max(batches), 16)).tolist()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rates = {}
    for b in batches:
        runs = []
        for _ in range(repeats + 1):  # the first is the warm-up (compiles what the later ones run)
            outs = llm.generate(prompt_token_ids=prompts[:b], sampling_params=params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs), "EOS not ignored"
            span = max(o.metrics.finished_time for o in outs) - min(o.metrics.first_token_time for o in outs)
            runs.append(b * (new_tokens - 1) / span)
        rates[f"decode batch {b} tok/s"] = statistics.median(runs[1:])
print(json.dumps({"jaxserve": jaxserve.__file__, "rates": rates}))
"""


# ---- pure functions (tests/test_bench_before_after.py) ------------------------------------------------
def side_order(round_index: int) -> tuple[str, str]:
    """before, after in even rounds, after, before in odd ones (B A A B B A ...)."""
    return ("before", "after") if round_index % 2 == 0 else ("after", "before")


def verdict(before: list[float], after: list[float], higher_is_better: bool) -> str:
    """'ok' when after's median is within before's min..max or better, else 'SLOWER'."""
    med = statistics.median(after)
    return "ok" if (med >= min(before) if higher_is_better else med <= max(before)) else "SLOWER"


def host_metrics(report: dict) -> dict[str, tuple[float, bool, bool]]:
    """name -> (value, higher_is_better, valid) from a bench_host_overhead JSON report (a point is
    invalid when its timed steps were not what it meant to time: see that script)."""
    out = {}
    for model in report["models"]:
        for p in model["points"]:
            if "error" in p:
                raise RuntimeError(f"bench_host_overhead {model['name']} B{p['batch']}: {p['error']}")
            mode = "on" if p["async_scheduling"] else "off"
            key = f"host {model['name']} B{p['batch']} ctx{p['context']} async {mode}"
            out[f"{key} engine tok/s"] = (p["engine_tokens_per_s"], True, p["valid"])
            out[f"{key} host us/step"] = (p["host_us"], False, p["valid"])
    return out


def summarize(
    samples: dict[str, dict[str, list[float]]], higher: dict[str, bool], invalid: dict[str, int] | None = None
) -> dict[str, dict]:
    """Per metric: both sides' values, medians, spreads and the verdict (naming invalid runs)."""
    rows = {}
    for name, sides in samples.items():
        row = {"higher_is_better": higher[name], "invalid_runs": (invalid or {}).get(name, 0)}
        for side in ("before", "after"):
            v = sides[side]
            row[side] = {"values": v, "median": statistics.median(v), "min": min(v), "max": max(v)}
        row["verdict"] = verdict(sides["before"], sides["after"], higher[name]) + (
            f" ({row['invalid_runs']} invalid runs)" if row["invalid_runs"] else ""
        )
        rows[name] = row
    return rows


# ---- running a tree -------------------------------------------------------------------------------------
def run_in(tree: str, argv: list[str], timeout: float = 3600) -> str:
    """stdout of `python ARGV` run in `tree` with it first on PYTHONPATH; a failure exits with its stderr."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"failed in {tree}: python {' '.join(argv)[:200]}\n{done.stderr[-4000:]}")
    return done.stdout


def git_commit(tree: str) -> str:
    def git(*a):
        return subprocess.run(["git", "-C", tree, *a], capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")  # tracked files changed since the commit
    return git("rev-parse", "--short", "HEAD") + (" (dirty)" if dirty else "")


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), "unknown")


def bench_once(kind: str, tree: str, args) -> dict[str, tuple[float, bool, bool]]:
    if kind == "host":
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "host.json")
            run_in(tree, ["scripts/bench_host_overhead.py", *args.host_args.split(), "--out", out])
            with open(out, encoding="utf-8") as f:
                report = json.load(f)
        try:
            return host_metrics(report)
        except RuntimeError as err:
            raise SystemExit(f"failed in {tree}: {err}") from None
    result = json.loads(
        run_in(tree, ["-c", DECODE_SNIPPET, str(args.new_tokens), str(args.repeats), args.batches])
        .strip()
        .splitlines()[-1]
    )
    if not result["jaxserve"].startswith(tree + os.sep):
        raise SystemExit(f"{tree}: the decode run imported {result['jaxserve']}")
    return {name: (rate, True, True) for name, rate in result["rates"].items()}


def print_table(report: dict) -> None:
    print(f"\n{report['date']}  {report['cpu']}  {report['rounds']} rounds, alternating")
    for side in ("before", "after"):
        print(f"  {side:>6}: {report[side]['dir']} at {report[side]['commit']}")
    w = max(len(n) for n in report["metrics"])
    head = f"{'metric':<{w}}  {'before':>9} {'spread':>19}  {'after':>9} {'spread':>19}  {'after/bef':>9}  verdict"
    print(head + "\n" + "-" * len(head))
    for name, r in report["metrics"].items():
        b, a = r["before"], r["after"]
        print(
            f"{name:<{w}}  {b['median']:9.1f} {b['min']:9.1f}..{b['max']:<8.1f}  {a['median']:9.1f} "
            f"{a['min']:9.1f}..{a['max']:<8.1f}  {a['median'] / b['median']:9.3f}  {r['verdict']}"
        )
    print(
        "tok/s: higher is better; host us/step: lower is better; ok = after's median within before's spread or better"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="source tree before the change (a git worktree)")
    ap.add_argument("--after", required=True, help="source tree after the change")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; each runs every benchmark on both sides")
    ap.add_argument("--host-args", default=None, help=f"arguments for bench_host_overhead.py (default: {HOST_ARGS!r})")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt by the decode runs")
    ap.add_argument("--repeats", type=int, default=3, help="timed generates per decode run (median), after a warm-up")
    ap.add_argument("--batches", default="1,16", help="decode batch sizes")
    ap.add_argument("--skip", default="", help="comma list of host, decode: benchmarks left out")
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"checks the script runs: host {HOST_ARGS_QUICK!r}, decode batches 1,2 of 8 tokens, 1 repeat",
    )
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    skip = {k for k in args.skip.split(",") if k}
    kinds = [k for k in ("host", "decode") if k not in skip]
    if skip - {"host", "decode"} or not kinds:
        ap.error("--skip takes at most one of host, decode")
    if args.quick:
        args.new_tokens, args.repeats, args.batches = 8, 1, "1,2"
    if args.host_args is None:
        args.host_args = HOST_ARGS_QUICK if args.quick else HOST_ARGS
    trees = {"before": os.path.realpath(args.before), "after": os.path.realpath(args.after)}
    for side, tree in trees.items():  # the PYTHONPATH must win over an installed (editable) jaxserve
        where = run_in(tree, ["-c", "import jaxserve; print(jaxserve.__file__)"]).strip()
        if not where.startswith(tree + os.sep):
            raise SystemExit(f"--{side} {tree} imports jaxserve from {where}")

    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    samples: dict[str, dict[str, list[float]]] = {}
    higher: dict[str, bool] = {}
    invalid: dict[str, int] = {}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for kind in kinds:
            for side in side_order(r):
                t = time.perf_counter()
                for name, (value, hib, valid) in bench_once(kind, trees[side], args).items():
                    samples.setdefault(name, {"before": [], "after": []})[side].append(value)
                    higher[name] = hib
                    invalid[name] = invalid.get(name, 0) + (not valid)
                print(f"round {r + 1}/{args.rounds} {kind:>6} {side:>6}: {time.perf_counter() - t:.0f} s", flush=True)
    missing = [n for n, s in samples.items() if len(s["before"]) != len(s["after"])]
    if missing:  # e.g. a bench_host_overhead.py whose points differ between the trees
        raise SystemExit(f"metrics measured on one side only: {missing}")
    report = {
        "date": date,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "rounds": args.rounds,
        "before": {"dir": trees["before"], "commit": git_commit(trees["before"])},
        "after": {"dir": trees["after"], "commit": git_commit(trees["after"])},
        "settings": {
            "host_args": args.host_args,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "batches": args.batches,
            "benchmarks": kinds,
        },
        "metrics": summarize(samples, higher, invalid),
        "elapsed_s": time.perf_counter() - t0,
    }
    print_table(report)
    print(f"elapsed {report['elapsed_s']:.0f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
