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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
