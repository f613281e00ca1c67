"""Executable load time under XLA flags and layer modes: the default model's shape (dummy weights) with
a small bucket table, compiled into an empty executable store by one process, then loaded from it by
`--loads` fresh processes; each reports its compile or load seconds and the batch-1 decode ms/token.

Issue 52 asks for every executable loaded <= 5 s on a warm start; on XLA:CPU loading an unrolled step
links its code (~1-2 s each for the default model's 30 layers). This measures whether a flag (passed
in XLA_FLAGS, which the store's key holds) or scanning the layers changes that, and at what decode cost.

    python scripts/bench_startup_flags.py                                   # unrolled, no flags
    python scripts/bench_startup_flags.py --variant "unrolled|--xla_cpu_parallel_codegen_split_count=1" \\
        --variant "scanned|"

A variant is "LAYERS|XLA_FLAGS" (LAYERS: unrolled or scanned). The processes run from a copy of the
source taken at the start, as in scripts/bench_startup_weights.py (the store's key holds its hash).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_startup_weights import snapshot  # noqa: E402

ENGINE = """
import json, os, sys, time
from jaxserve import LLM, SamplingParams
cache, scan = sys.argv[1], sys.argv[2] == "scanned"
start = time.perf_counter()
llm = LLM("configs/models/smollm2-135m", load_format="dummy", compilation_cache_dir=cache, max_num_seqs=1,
          max_num_batched_tokens=16, token_buckets="powers-of-two", max_model_len=256, scan_layers=scan,
          compile_in_background=False)
ready = time.perf_counter() - start
table = llm.runner.table
params = SamplingParams(max_tokens=65, temperature=0, ignore_eos=True)
llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params)
best = float("inf")
for _ in range(3):
    t = time.perf_counter()
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params)
    best = min(best, time.perf_counter() - t)
print(json.dumps(dict(ready_s=round(ready, 2), compiled=len(table.compiled),
                      compile_s=round(sum(s for _, s in table.compiled), 2), loaded=len(table.loaded),
                      load_s=round(sum(s for _, s in table.loaded), 2), decode_ms=round(best / 65 * 1e3, 1))))
"""


def run_engine(cache: str, layers: str, flags: str, data: str, cwd: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": flags, "JAXSERVE_EXECUTABLE_STORE": "1", "JAXSERVE_CACHE": data}
    done = subprocess.run(
        [sys.executable, "-c", ENGINE, cache, layers], env=env, capture_output=True, text=True, timeout=1800, cwd=cwd
    )
    if done.returncode != 0:
        raise RuntimeError(f"{layers} {flags!r} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", help='"LAYERS|XLA_FLAGS" (default: "unrolled|")')
    parser.add_argument("--loads", type=int, default=2, help="fresh processes loading from the filled store")
    parser.add_argument("--out", default=None, help="append each result as a JSON line here")
    args = parser.parse_args(argv)
    results = []
    source = tempfile.TemporaryDirectory(prefix="jaxserve-flags-src-")
    cwd = snapshot(source.name)
    for variant in args.variant or ["unrolled|"]:
        layers, _, flags = variant.partition("|")
        if layers not in ("unrolled", "scanned"):
            parser.error(f"variant {variant!r}: LAYERS is unrolled or scanned")
        with tempfile.TemporaryDirectory(prefix="jaxserve-flags-") as root:
            cache, data = os.path.join(root, "cache"), os.path.join(root, "data")
            runs = [run_engine(cache, layers, flags, data, cwd) for _ in range(1 + args.loads)]
        result = dict(
            layers=layers,
            xla_flags=flags,
            compile=runs[0],
            loads=runs[1:],
            date=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            load_avg=os.getloadavg(),
        )
        print(json.dumps(result), flush=True)
        results.append(result)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    source.cleanup()
    return results


if __name__ == "__main__":
    main()
