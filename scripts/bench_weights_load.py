"""The weights' load from jaxserve's laid-out copy (`loading/converted_weights.py`), source trees
alternated: what a warm start spends placing a model's weights once the copy is in the page cache.

Each tree loads the model once to write its own copy (the cache key holds the source's hash, so each
tree keeps one, under a temporary $JAXSERVE_CACHE of its own), then `--rounds` times in a fresh
process each, the trees alternated (A B B A ...: a linear drift of a shared machine hits both alike).
The copy is read once before each load so that it comes from the page cache: the figure is the
checking, widening and placing, not the disk (scripts/bench_startup_weights.py times a start with
the disk read in it).

    python scripts/bench_weights_load.py --trees /tmp/before,. --rounds 3
    python scripts/bench_weights_load.py --model out/llama-3.2-1b-random --dtype float32 --trees .
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_startup_weights import LOAD_WEIGHTS  # noqa: E402


def load_once(tree: str, model: str, dtype: str, cache: str) -> float:
    env = {**os.environ, "JAXSERVE_CACHE": cache, "JAXSERVE_WEIGHTS_CACHE": "1", "PYTHONPATH": tree}
    done = subprocess.run(
        [sys.executable, "-c", LOAD_WEIGHTS, model, dtype], env=env, cwd=tree, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def read_copy(cache: str) -> None:
    """Read the laid-out copy once, so the next load finds it in the page cache."""
    folder = os.path.join(cache, "weights")
    for name in os.listdir(folder):
        if name.endswith(".bin"):
            with open(os.path.join(folder, name), "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="out/llama-3.2-1b-random", help="a safetensors model directory")
    parser.add_argument("--dtype", default="float32", help="the dtype the model runs in")
    parser.add_argument("--trees", default=".", help="comma-separated source trees (each with jaxserve/)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="append the result as a JSON line")
    args = parser.parse_args(argv)
    model = os.path.abspath(args.model)
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    caches = {tree: tempfile.mkdtemp(prefix="jaxserve-weights-bench-") for tree in trees}
    seconds: dict[str, list[float]] = {tree: [] for tree in trees}
    try:
        first = {tree: load_once(tree, model, args.dtype, caches[tree]) for tree in trees}  # writes each copy
        for r in range(args.rounds):
            for tree in trees if r % 2 == 0 else trees[::-1]:
                read_copy(caches[tree])
                seconds[tree].append(load_once(tree, model, args.dtype, caches[tree]))
                print(tree, seconds[tree][-1], f"load {os.getloadavg()}", flush=True)
    finally:
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
    result = dict(
        model=model,
        dtype=args.dtype,
        date=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        load_avg=os.getloadavg(),
        first_load_writing_the_copy_s=first,
        mapped_copy_s=seconds,
        median_s={tree: statistics.median(s) for tree, s in seconds.items()},
    )
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
