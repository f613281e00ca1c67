"""Start-up of `python -m jaxserve.serve`: seconds until /health answers, to the first streamed token of
a chat, executables, peak RSS.

Each start runs the server as a subprocess with its own compilation cache directory (the executable
store and XLA's persistent cache): "cold" starts from an empty one, "warm" starts again on the
directory the cold start filled. The server is stopped (SIGTERM) once it answered a chat's first
token, and its executables gauge and peak RSS (VmHWM) are read. Extra arguments after `--` go to the
server.

    python scripts/bench_startup.py --out out/startup.json
    python scripts/bench_startup.py --label ngram8 -- --speculative-method ngram --num-speculative-tokens 8
    python scripts/bench_startup.py --compare-store --rounds 3   # before (--no-executable-store) vs after, alternated
    python scripts/bench_startup.py --warm-background   # a warm start serving while the rest load from the store
    python scripts/bench_startup.py --compare-tree /tmp/before --rounds 2   # another commit's source (git archive) vs this tree
    python scripts/bench_startup.py --compare-background --rounds 1   # cold starts: all compiled first vs serving
                                                                     # while the rest compile (TTFT, TPOT meanwhile)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request


def peak_rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def start_once(
    server_args: list[str],
    cache_dir: str,
    port: int,
    timeout_s: float,
    env: dict | None = None,
    measure=None,
    cwd: str | None = None,
) -> dict:
    """One start; `measure(port, start)`, if given, runs once the first chat answered and its dict
    joins the result. `cwd`: where the server runs (a copy of the source, scripts/bench_startup_weights.py)."""
    cmd = [
        sys.executable,
        "-m",
        "jaxserve.serve",
        "--port",
        str(port),
        "--compilation-cache-dir",
        cache_dir,
        *server_args,
    ]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("JAXSERVE_EXECUTABLE_STORE", "JAXSERVE_WEIGHTS_CACHE")},
        **(env or {}),
    }
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    ready = None
    try:
        while time.perf_counter() - start < timeout_s:
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        ready = time.perf_counter() - start
                        break
            except OSError:
                time.sleep(0.25)
        executables = first_token = None
        measured = {}
        if ready is not None:
            first_token = first_chat_token(port) - start
            measured = measure(port, start) if measure is not None else {}
            executables = metrics(port).get("jaxserve:executables")
            executables = None if executables is None else int(executables)
        rss = peak_rss_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if ready is None:
        log.seek(0)
        raise RuntimeError(f"server not ready after {timeout_s} s (exit {proc.returncode}):\n{log.read()[-3000:]}")
    log.seek(0)
    text = log.read()
    opened = re.search(r"with token buckets ([0-9, ]+) of (\d+)", text)
    store = re.search(r"(\d+) step executables loaded in ([0-9.]+)s", text)
    return dict(
        ready_s=round(ready, 1),
        first_token_s=round(first_token, 1),
        executables=executables,
        loaded_from_store=text.count("loaded from the executable store"),
        compiled=len(re.findall(r"bucket \S.* compiled in", text)) + len(re.findall(r"token bucket \d+ ready", text)),
        opened_buckets=opened.group(1) if opened else None,
        store_loaded=int(store.group(1)) if store else None,
        store_load_s=float(store.group(2)) if store else None,
        weights_s=log_seconds(text, r"INFO jaxserve.serve: loading ", r"INFO jaxserve.llm_engine: memory plan"),
        peak_rss_mib=round(rss or 0.0),
        **measured,
    )


def log_seconds(text: str, first: str, second: str) -> float | None:
    """Seconds between the log lines matching `first` and `second` (their timestamps), None if either
    is missing: "loading" to "memory plan" is the weights read and placed (plus the backend's start)."""
    stamps = []
    for pattern in (first, second):
        m = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*" + pattern, text, re.M)
        if m is None:
            return None
        stamps.append(time.mktime(time.strptime(m.group(1)[:19], "%Y-%m-%d %H:%M:%S")) + int(m.group(1)[20:]) / 1e3)
    return round(stamps[1] - stamps[0], 1)


def metrics(port: int) -> dict[str, float]:
    """The server's unlabelled /metrics samples."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([a-z_:]+) ([-+0-9.eE]+)$", text, re.M)}


def stream_completion(port: int, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """(seconds to the first token, perf_counter() of each streamed token) of a greedy completion."""
    body = json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    sent, times = time.perf_counter(), []
    with urllib.request.urlopen(request, timeout=900) as r:
        for line in r:
            if line.startswith(b"data: {") and (json.loads(line[6:]).get("choices") or [{}])[0].get("text"):
                times.append(time.perf_counter())
    return times[0] - sent, times


def long_prompt(port: int, tokens: int = 1000) -> tuple[str, int]:
    """A prompt of about `tokens` tokens (counted by the server's /tokenize)."""
    words = "the river runs past the old stone mill where the miller keeps his grain and his cats".split()
    text = " ".join(words[i % len(words)] for i in range(tokens))
    body = json.dumps({"prompt": text}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        n = json.loads(r.read())["count"]
    return " ".join(text.split()[: int(len(text.split()) * tokens / n)]), tokens


def speed(port: int, prompt: str, tag: str) -> dict:
    """TTFT of the long prompt (one token) headed by `tag` (so no earlier measurement's KV pages
    serve it from the prefix cache), then the decode time per output token of a 64-token completion
    of a short prompt, with the token buckets ready before and after each."""
    ready = metrics(port).get("jaxserve:step_buckets_ready")
    ttft, _ = stream_completion(port, f"{tag}: {prompt}", 1)
    _, times = stream_completion(port, "Once upon a time", 64)
    return dict(
        buckets_ready=[ready, metrics(port).get("jaxserve:step_buckets_ready")],
        ttft_1k_s=round(ttft, 2),
        tpot_ms=round(1e3 * (times[-1] - times[0]) / (len(times) - 1), 1),
    )


def measure_background(port: int, start: float) -> dict:
    """While the rest compile: the long prompt's TTFT and the decode TPOT; when every bucket is ready
    (seconds from process start); the same figures once all are."""
    prompt, _ = long_prompt(port)
    m = metrics(port)
    if m.get("jaxserve:step_buckets_ready") == m.get("jaxserve:step_buckets_total"):  # all compiled before /health
        return {"all_ready_s": None, "all_ready": speed(port, prompt, "Later")}
    out = {"while_compiling": speed(port, prompt, "First")}
    while True:
        m = metrics(port)
        if m.get("jaxserve:step_buckets_ready") == m.get("jaxserve:step_buckets_total"):
            break
        time.sleep(0.5)
    out["all_ready_s"] = round(time.perf_counter() - start, 1)
    out["bucket_compile_s"] = round(m.get("jaxserve:step_bucket_compile_seconds", 0.0), 1)
    out["all_ready"] = speed(port, prompt, "Later")
    return out


def first_chat_token(port: int) -> float:
    """perf_counter() when the first content delta of a streamed chat arrives."""
    body = json.dumps(
        {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8, "stream": True}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                delta = choices[0].get("delta") or {}
                # The first chunk after the role's: a token's, even one a random model's ids past the
                # tokenizer's vocabulary decode to "" (configs/llama-3.2-1b.yaml)
                if "content" in delta and "role" not in delta:
                    return time.perf_counter()
    raise RuntimeError("the chat streamed no token")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--label", default="default")
    parser.add_argument("--port", type=int, default=8190)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=None, help="append the result as a JSON line here")
    parser.add_argument(
        "--compare-store",
        action="store_true",
        help="before (--no-executable-store: XLA's persistent cache only) against after (the executable store): "
        "a cold start of each, then --rounds warm starts of each, alternated",
    )
    parser.add_argument(
        "--compare-background",
        action="store_true",
        help="cold starts (every cache empty), before (--no-compile-in-background) and after (serving while the "
        "rest compile), alternated --rounds times: /health, first chat token, TTFT of a 1,000-token prompt and "
        "decode TPOT while compiling and once all are ready, time to all ready",
    )
    parser.add_argument(
        "--warm-background",
        action="store_true",
        help="a cold start compiling every bucket (filling the store), then a warm start serving while the rest "
        "load (--compile-in-background): /health, first chat token, all buckets ready, TTFT and TPOT meanwhile",
    )
    parser.add_argument(
        "--compare-tree",
        metavar="DIR",
        help="before: the server run from DIR, a copy of another commit's source (git archive COMMIT jaxserve "
        "pallas_kernels configs | tar -x -C DIR), against after: this tree; a cold start of each on caches of "
        "its own, then --rounds warm starts of each, alternated (with --warm-background: --rounds of its "
        "two starts for each tree, alternated)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="warm starts of each with --compare-store / --compare-tree"
    )
    args, server_args = parser.parse_known_args(argv)
    server_args = [a for a in server_args if a != "--"]
    server_args = ["--config", args.config, *server_args]
    if not (args.compare_background or args.warm_background) and not any(
        "compile-in-background" in a for a in server_args
    ):
        # The server stops at its first token: compiling in the background, a cold start would store only
        # the opening buckets and the warm start after it would load a partial store. Every executable
        # ready before /health, so a warm start's /health is "every executable loaded".
        server_args.append("--no-compile-in-background")
    if args.warm_background and args.compare_tree:
        result = warm_background_trees(server_args, args)
    elif args.warm_background:
        result = warm_background(server_args, args)
    elif args.compare_store:
        result = compare_store(server_args, args)
    elif args.compare_tree:
        result = compare_tree(server_args, args)
    elif args.compare_background:
        result = compare_background(server_args, args)
    else:
        with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as cache:
            cold = start_once(server_args, cache, args.port, args.timeout)
            warm = start_once(server_args, cache, args.port, args.timeout)
        result = dict(label=args.label, server_args=server_args, cold=cold, warm=warm)
    result.update(date=time.strftime("%Y-%m-%d %H:%M"), load_avg=os.getloadavg())
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


def compare_store(server_args: list[str], args: argparse.Namespace) -> dict:
    """Cold then alternated warm starts, before (store and converted-weights cache off) and after (both
    on), each on caches of its own (the GGUF metadata's and converted weights' under its own JAXSERVE_CACHE)."""
    modes = {"before": ["--no-executable-store"], "after": []}
    envs = {"before": {"JAXSERVE_WEIGHTS_CACHE": "0"}, "after": {}}
    result: dict = dict(label=args.label, server_args=server_args, cold={}, warm={m: [] for m in modes})
    with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as root:
        caches = {m: os.path.join(root, m) for m in modes}
        for mode in modes:
            envs[mode]["JAXSERVE_CACHE"] = os.path.join(root, mode + "-data")
        for mode, extra in modes.items():
            result["cold"][mode] = start_once([*server_args, *extra], caches[mode], args.port, args.timeout, envs[mode])
            print(mode, "cold", result["cold"][mode], flush=True)
        for _ in range(args.rounds):
            for mode, extra in modes.items():
                run = start_once([*server_args, *extra], caches[mode], args.port, args.timeout, envs[mode])
                result["warm"][mode].append(run)
                print(mode, "warm", run, flush=True)
    return result


def compare_tree(server_args: list[str], args: argparse.Namespace) -> dict:
    """Cold then alternated warm starts of the server from another source tree (before) and from this one
    (after), each on a compilation cache and JAXSERVE_CACHE of its own; the load average after each."""
    cwds = {"before": os.path.abspath(args.compare_tree), "after": os.path.dirname(os.path.dirname(__file__)) or "."}
    result: dict = dict(
        label=args.label, server_args=server_args, before=cwds["before"], cold={}, warm={m: [] for m in cwds}
    )
    with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as root:
        envs = {m: {"JAXSERVE_CACHE": os.path.join(root, m + "-data")} for m in cwds}
        caches = {m: os.path.join(root, m) for m in cwds}
        for mode, cwd in cwds.items():
            result["cold"][mode] = start_once(server_args, caches[mode], args.port, args.timeout, envs[mode], cwd=cwd)
            print(mode, "cold", json.dumps(result["cold"][mode]), f"load {os.getloadavg()}", flush=True)
        for _ in range(args.rounds):
            for mode, cwd in cwds.items():
                run = start_once(server_args, caches[mode], args.port, args.timeout, envs[mode], cwd=cwd)
                run["load_avg"] = os.getloadavg()
                result["warm"][mode].append(run)
                print(mode, "warm", json.dumps(run), flush=True)
    return result


def compare_background(server_args: list[str], args: argparse.Namespace) -> dict:
    """Cold starts, every cache empty (its own compilation cache and JAXSERVE_CACHE each time), before
    (all buckets compiled before /health) and after (serving while the rest compile), alternated."""
    modes = {"before": ["--no-compile-in-background"], "after": ["--compile-in-background"]}
    result: dict = dict(label=args.label, server_args=server_args, cold={m: [] for m in modes})
    for _ in range(args.rounds):
        for mode, extra in modes.items():
            with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as root:
                env = {"JAXSERVE_CACHE": os.path.join(root, "data")}
                run = start_once(
                    [*server_args, *extra],
                    os.path.join(root, "cache"),
                    args.port,
                    args.timeout,
                    env,
                    measure_background,
                )
            result["cold"][mode].append(run)
            print(mode, "cold", json.dumps(run), f"load {os.getloadavg()}", flush=True)
    return result


def warm_background(server_args: list[str], args: argparse.Namespace, cwd: str | None = None) -> dict:
    """A cold start compiling every bucket before /health (so the store holds them all), then a warm
    start on the same caches serving while the rest load (the server run from `cwd`)."""
    with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as root:
        env = {"JAXSERVE_CACHE": os.path.join(root, "data")}
        cache = os.path.join(root, "cache")
        cold = start_once([*server_args, "--no-compile-in-background"], cache, args.port, args.timeout, env, cwd=cwd)
        warm = start_once(
            [*server_args, "--compile-in-background"], cache, args.port, args.timeout, env, measure_background, cwd
        )
    return dict(label=args.label, server_args=server_args, cold=cold, warm=warm, load_avg=os.getloadavg())


def warm_background_trees(server_args: list[str], args: argparse.Namespace) -> dict:
    """`warm_background` of --compare-tree's source (before) and this tree's (after), alternated --rounds times."""
    cwds = {"before": os.path.abspath(args.compare_tree), "after": os.path.dirname(os.path.dirname(__file__)) or "."}
    result: dict = dict(label=args.label, server_args=server_args, before=cwds["before"], runs={m: [] for m in cwds})
    for _ in range(args.rounds):
        for mode, cwd in cwds.items():
            run = warm_background(server_args, args, cwd)
            result["runs"][mode].append(run)
            print(mode, json.dumps(run["warm"]), f"load {run['load_avg']}", flush=True)
    return result


if __name__ == "__main__":
    main()
