"""Start-up of `python -m jaxserve.serve`: seconds until /health answers, executables, peak RSS.

Each start runs the server as a subprocess with its own persistent compilation cache directory:
"cold" starts from an empty one, "warm" starts again on the directory the cold start filled. The
server is stopped (SIGTERM) as soon as it is ready and its executables gauge and peak RSS (VmHWM)
are read. Extra arguments after `--` go to the server.

    python scripts/bench_startup.py --out out/startup.json
    python scripts/bench_startup.py --label ngram8 -- --speculative-method ngram --num-speculative-tokens 8
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


def start_once(server_args: list[str], cache_dir: str, port: int, timeout_s: float) -> dict:
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
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
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
        executables = None
        if ready is not None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                m = re.search(rb"^jaxserve:executables ([0-9.]+)", r.read(), re.M)
                executables = int(float(m.group(1))) if m else None
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
    return dict(ready_s=round(ready, 1), executables=executables, peak_rss_mib=round(rss or 0.0))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--label", default="default")
    parser.add_argument("--port", type=int, default=8190)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=None, help="append the result as a JSON line here")
    args, server_args = parser.parse_known_args(argv)
    server_args = [a for a in server_args if a != "--"]
    server_args = ["--config", args.config, *server_args]
    with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as cache:
        cold = start_once(server_args, cache, args.port, args.timeout)
        warm = start_once(server_args, cache, args.port, args.timeout)
    result = dict(
        label=args.label,
        server_args=server_args,
        cold=cold,
        warm=warm,
        date=time.strftime("%Y-%m-%d %H:%M"),
        load_avg=os.getloadavg(),
    )
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
