"""A warm start against the time to read the model's weights from disk (issue 52: a 1B-parameter
Llama-shaped model's warm start <= 3x that time), unrolled and scanned layers.

For each layer kind: a cold start on an empty compilation cache (it compiles every step and fills
the executable store), then `--rounds` warm starts of each mode on that store, the modes alternated.
Before every warm start the weight files are read once with the page cache dropped for them
(`posix_fadvise(DONTNEED)`, no root needed: "read_cold_s") and dropped again, with jaxserve's
laid-out copy of them, so the server reads from the disk too; the same read with the pages cached
("read_warm_s") is reported beside it. A start's /health is "every executable loaded"
(`--no-compile-in-background`) except in the "-bg" modes; the first streamed chat token, the
weights' part (log lines "loading" to "memory plan") and the store's load time come from
scripts/bench_startup.py.

The server runs from a copy of jaxserve's source taken at the script's start (`--no-snapshot`: from
the working tree), because the store's key holds a hash of the source: an edit made elsewhere in a
shared tree during the run would make the warm starts compile.

    python scripts/make_random_checkpoint.py --out out/llama-3.2-1b-random   # once: 2.5 GB of bf16
    python scripts/bench_startup_weights.py --config configs/llama-3.2-1b.yaml --weights out/llama-3.2-1b-random
    python scripts/bench_startup_weights.py --modes unrolled,unrolled-nocache,unrolled-bg --rounds 1
    python scripts/bench_startup_weights.py --weights-only --rounds 3   # the weights' load alone, no server
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_startup import metrics, start_once  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# mode -> (server arguments, environment). "-nocache": the weights laid out from the checkpoint at every
# start instead of mapped from jaxserve's cache (loading/converted_weights.py); "-bg": serving while the
# other buckets load (--compile-in-background, the server's default): /health once the opening buckets
# are in, and "all_ready_s" when every bucket is. Modes of one layer kind share one executable store.
MODES = {
    "unrolled": (["--scan-layers", "false"], {}),
    "scanned": (["--scan-layers", "true"], {}),
    "unrolled-nocache": (["--scan-layers", "false"], {"JAXSERVE_WEIGHTS_CACHE": "0"}),
    "scanned-nocache": (["--scan-layers", "true"], {"JAXSERVE_WEIGHTS_CACHE": "0"}),
    "unrolled-bg": (["--scan-layers", "false", "--compile-in-background"], {}),
    "scanned-bg": (["--scan-layers", "true", "--compile-in-background"], {}),
}
SNAPSHOT_DIRS = ("jaxserve", "pallas_kernels", "configs", "checkpoints/default")


def weight_files(model_dir: str) -> list[str]:
    names = sorted(n for n in os.listdir(model_dir) if n.endswith((".safetensors", ".gguf")))
    if not names:
        raise SystemExit(f"{model_dir} holds no .safetensors or .gguf file")
    return [os.path.join(model_dir, n) for n in names]


def drop_cached(paths: list[str]) -> None:
    """Ask the kernel to drop these files' cached pages (clean pages go; no root needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_weights(data_dir: str) -> list[str]:
    """The laid-out weights jaxserve keeps under $JAXSERVE_CACHE (dropped from the page cache too)."""
    folder = os.path.join(data_dir, "weights")
    return [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".bin")] if os.path.isdir(folder) else []


def read_seconds(paths: list[str], chunk: int = 64 << 20) -> tuple[float, int]:
    """Seconds to read the files start to end into one reused buffer, and the bytes read."""
    buf = memoryview(bytearray(chunk))
    start, total = time.perf_counter(), 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return time.perf_counter() - start, total


def read_times(paths: list[str]) -> dict:
    drop_cached(paths)
    cold, total = read_seconds(paths)
    warm, _ = read_seconds(paths)
    return dict(read_cold_s=round(cold, 2), read_warm_s=round(warm, 2), weight_bytes=total)


def all_ready(port: int, start: float) -> dict:
    """Seconds from process start until every token bucket is ready (serving while the rest load)."""
    while True:
        m = metrics(port)
        if m.get("jaxserve:step_buckets_ready") == m.get("jaxserve:step_buckets_total"):
            return dict(all_ready_s=round(time.perf_counter() - start, 1))
        time.sleep(0.2)


LOAD_WEIGHTS = """
import json, sys, time
import jax
from jaxserve.config import EngineConfig
from jaxserve.loading.model_loader import load_model
from jaxserve.model.sharding import make_mesh
mesh = make_mesh((1, 1))
start = time.perf_counter()
params = load_model(EngineConfig(model=sys.argv[1], dtype=sys.argv[2], scan_layers=False), mesh, stacked=False).params
jax.block_until_ready(params)
print(json.dumps(dict(seconds=round(time.perf_counter() - start, 2))))
"""


def weights_only(weights: str, dtype: str, rounds: int, cwd: str, root: str) -> dict:
    """The weights alone (`load_model`, unrolled) in a fresh process each time: a first load that lays
    them out and writes jaxserve's copy, then `rounds` loads mapping that copy alternated with
    `rounds` laying them out again from the checkpoint ($JAXSERVE_WEIGHTS_CACHE=0); before each, the
    checkpoint is read once with its pages dropped ("read_cold_s") and every file's pages dropped again."""
    data = os.path.join(root, "weights-data")
    out: dict = {
        "first_load_writing_the_copy_s": None,
        "mapped_copy_s": [],
        "laid_out_at_load_s": [],
        "read_cold_s": [],
    }
    order = [("first_load_writing_the_copy_s", "1")] + [
        run for _ in range(rounds) for run in (("mapped_copy_s", "1"), ("laid_out_at_load_s", "0"))
    ]
    files = weight_files(weights)
    for name, cache in order:
        out["read_cold_s"].append(read_times(files)["read_cold_s"])
        drop_cached(files + cached_weights(data))
        env = {**os.environ, "JAXSERVE_CACHE": data, "JAXSERVE_WEIGHTS_CACHE": cache}
        done = subprocess.run(
            [sys.executable, "-c", LOAD_WEIGHTS, weights, dtype], env=env, cwd=cwd, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
        if isinstance(out[name], list):
            out[name].append(seconds)
        else:
            out[name] = seconds
        print(name, seconds, f"load {os.getloadavg()}", flush=True)
    return out


def snapshot(root: str) -> str:
    """A copy of the source the server imports (and the configs it names) under `root`."""
    for name in SNAPSHOT_DIRS:
        src = os.path.join(REPO, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(root, name), ignore=shutil.ignore_patterns("__pycache__"))
    return root


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/llama-3.2-1b.yaml")
    parser.add_argument("--weights", default="out/llama-3.2-1b-random", help="the model directory to serve")
    parser.add_argument("--modes", default="unrolled,scanned", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--rounds", type=int, default=2, help="warm starts of each mode, alternated")
    parser.add_argument("--port", type=int, default=8192)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--no-snapshot", action="store_true", help="run the server from the working tree")
    parser.add_argument("--out", default=None, help="append the result as a JSON line here")
    parser.add_argument(
        "--weights-only",
        action="store_true",
        help="only the weights' load (no server): jaxserve's laid-out copy mapped against laid out at load, "
        "alternated --rounds times",
    )
    parser.add_argument("--dtype", default="float32", help="with --weights-only: the dtype the model runs in")
    args, extra = parser.parse_known_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    weights = os.path.abspath(args.weights)
    files = weight_files(weights)
    server_args = [
        "--config",
        os.path.abspath(args.config) if args.no_snapshot else args.config,
        "--model",
        weights,
        "--load-format",
        "auto",
        *[a for a in extra if a != "--"],
    ]
    result: dict = dict(server_args=server_args, cold={}, warm={m: [] for m in modes})
    with tempfile.TemporaryDirectory(prefix="jaxserve-startup-weights-") as root:
        cwd = REPO if args.no_snapshot else snapshot(os.path.join(root, "src"))
        if args.weights_only:
            result = dict(weights_only=weights_only(weights, args.dtype, args.rounds, cwd, root), dtype=args.dtype)
            modes = []
        # One executable store and one $JAXSERVE_CACHE per layer mode: jaxserve keeps one laid-out copy of
        # a model's weights, so unrolled and scanned starts on one cache would replace each other's.
        caches = {m: os.path.join(root, "cache-" + m.split("-")[0]) for m in modes}
        data = {m: os.path.join(root, "data-" + m.split("-")[0]) for m in modes}

        def start(mode: str, cold: bool = False) -> dict:
            extra, mode_env = MODES[mode]
            background = "--compile-in-background" in extra and not cold  # a cold start stores every bucket
            extra = [a for a in extra if a != "--compile-in-background"]
            extra.append("--compile-in-background" if background else "--no-compile-in-background")
            env = {"JAXSERVE_CACHE": data[mode], **mode_env}
            measure = all_ready if background else None
            return start_once([*server_args, *extra], caches[mode], args.port, args.timeout, env, measure, cwd)

        for mode in modes:
            if os.path.isdir(caches[mode]):
                continue  # its store was filled by another mode's cold start
            drop_cached(files)
            result["cold"][mode] = run = start(mode, cold=True)
            print(mode, "cold", json.dumps(run), f"load {os.getloadavg()}", flush=True)
        for _ in range(args.rounds):
            for mode in modes:
                reads = read_times(files)
                drop_cached(files + cached_weights(data[mode]))
                run = start(mode)
                run.update(reads, ratio_to_cold_read=round(run["ready_s"] / reads["read_cold_s"], 1))
                result["warm"][mode].append(run)
                print(mode, "warm", json.dumps(run), f"load {os.getloadavg()}", flush=True)
    result.update(date=time.strftime("%Y-%m-%d %H:%M", time.gmtime()), load_avg=os.getloadavg())
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
