"""Compile time and decode speed of the layer stack scanned (`lax.scan` over stacked weights) against
unrolled (one traced block per layer), for the default model's server settings (issue 52, part 5).

Each variant is an engine built in its own subprocess with every compilation cache off, so each
bucket is traced, lowered and compiled from nothing; the script reports the seconds per bucket
(trace + lower + compile), the whole warm-up, and batch-1 greedy decode speed once warm.

    python scripts/bench_compile_scan.py --out out/compile_scan.jsonl
    python scripts/bench_compile_scan.py -- --max-num-batched-tokens 64   # extra serve flags after --
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
from jaxserve.serve import build_parser, resolve_settings
from jaxserve.runner.compilation import CompileCounter
args = json.loads(sys.argv[1])
settings, _, _ = resolve_settings(build_parser().parse_args(args["flags"]))
settings = settings.replace(scan_layers=args["scan"], compilation_cache=False, executable_store=False)
from jaxserve.llm_engine import LLMEngine
from jaxserve.sampling.params import SamplingParams
engine = LLMEngine(settings, warm_up=False)
runner = engine.runner
timings = {}
for key in runner.step_shapes():
    start = time.perf_counter()
    lowered = runner.table.lower(key)
    traced = time.perf_counter() - start
    runner.table.executables[key] = lowered.compile(runner.table.compiler_options)
    timings[str(key)] = [round(traced, 2), round(time.perf_counter() - start - traced, 2)]
start = time.perf_counter()
engine.warm_up()  # the rest (page copies, first runs): nothing left to compile but those
warm = time.perf_counter() - start
engine.add_request("r", prompt_token_ids=list(range(1, 65)), sampling_params=SamplingParams(max_tokens=65, temperature=0, ignore_eos=True))
stamps = []
while engine.has_unfinished_requests():
    engine.step()
    stamps.append(time.perf_counter())
decode = (stamps[-1] - stamps[1]) / max(1, len(stamps) - 2)
print(json.dumps(dict(scan=args["scan"], buckets=timings, rest_of_warm_up_s=round(warm, 2),
                      decode_ms=round(1000 * decode, 2))))
"""


def run(scan: bool, flags: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps({"scan": scan, "flags": flags})],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "JAXSERVE_WEIGHTS_CACHE": os.environ.get("JAXSERVE_WEIGHTS_CACHE", "1")},
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["compile_s"] = round(sum(sum(v) for v in result["buckets"].values()), 1)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="each variant this many times, alternated")
    parser.add_argument("--out", default=None, help="append each result as a JSON line here")
    args, flags = parser.parse_known_args(argv)
    flags = [f for f in flags if f != "--"]
    for _ in range(args.rounds):
        for scan in (False, True):
            result = run(scan, flags)
            result.update(date=time.strftime("%Y-%m-%d %H:%M"), load_avg=os.getloadavg(), flags=flags)
            print(json.dumps(result), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
