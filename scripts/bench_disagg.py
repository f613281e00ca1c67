"""Colocated against disaggregated serving on one machine, from one run: output tok/s, TTFT, TPOT p99
and goodput at a stated SLO.

    nice -n 5 python scripts/bench_disagg.py [--model M] [--json out/bench_disagg.json]

Three setups serve the same workload (`jaxserve bench serve`: random prompts of --input-len token
ids, --output-len tokens each, ignore_eos, --num-prompts at --request-rate, streamed):

  colocated        one server, today's chunked prefill (max_num_batched_tokens from the config)
  colocated-small  one server, prefill chunks of --small-chunk tokens (--max-num-batched-tokens):
                   decodes wait less behind a prompt, prompts take more steps
  disaggregated    a prefill server (kv_producer) and a decode server (kv_consumer), the
                   JaxTransferConnector between them, behind `jaxserve disagg-proxy`

Goodput counts requests within --slo-ttft and --slo-tpot (ms). After the disaggregated run, --probe
requests one at a time split its TTFT: the prefill server's answer, then the decode server's first
token from the pulled pages, beside the decode server's own TTFT for a plain prompt of that length. Each server starts with warm-up
(every bucket compiled before /health), and the benchmark's first --warmups requests are not counted.
On one machine both engines of the disaggregated setup share the same cores, so this measures
correctness and overheads, not what separate accelerators would give (docs/disaggregation.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A subprocess on a free port, its output in a log file; `url` once healthy."""

    def __init__(self, argv: list[str], log: Path, port: int):
        self.port, self.url, self.log = port, f"http://127.0.0.1:{port}", log
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float = 900.0) -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log} exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.5)
        raise RuntimeError(f"{self.log}: not healthy in {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def server(args, log_dir: Path, name: str, *flags: str) -> Proc:
    port = free_port()
    # Every bucket compiled before /health: no request of the run waits for a compilation.
    argv = [
        sys.executable,
        "-m",
        "jaxserve.serve",
        "--port",
        str(port),
        "--no-access-log",
        "--no-compile-in-background",
    ]
    argv += ["--max-model-len", str(args.max_model_len)] + (["--model", args.model] if args.model else [])
    return Proc(argv + list(flags), log_dir / f"{name}.log", port)


def kv(role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "JaxTransferConnector", "kv_role": role})]


def bench(args, url: str, out: Path) -> dict:
    argv = [
        "--base-url", url, "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--random-token-range", "10:40000", "--request-rate", str(args.request_rate), "--ignore-eos",
        "--temperature", "0", "--seed", "0", "--num-warmups", str(args.warmups), "--disable-tqdm",
        "--goodput", f"ttft:{args.slo_ttft}", f"tpot:{args.slo_tpot}", "--metric-percentiles", "50,99",
        "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip
    rc = subprocess.call([sys.executable, "-m", "jaxserve.bench.cli", "serve", *argv], cwd=REPO)
    if rc != 0 or not out.exists():
        raise RuntimeError(f"bench serve failed ({rc}) against {url}")
    return json.loads(out.read_text())


def run_setup(args, name: str, log_dir: Path) -> dict:
    procs: list[Proc] = []
    try:
        if name == "colocated":
            procs.append(server(args, log_dir, name).wait_healthy())
            url = procs[0].url
        elif name == "colocated-small":
            procs.append(server(args, log_dir, name, "--max-num-batched-tokens", str(args.small_chunk)).wait_healthy())
            url = procs[0].url
        else:
            p = server(args, log_dir, "prefill", *kv("kv_producer"))
            d = server(args, log_dir, "decode", *kv("kv_consumer"))
            procs += [p, d]
            p.wait_healthy(), d.wait_healthy()
            port = free_port()
            proxy_argv = [sys.executable, "-m", "jaxserve.serving.disagg_proxy", "--port", str(port)]
            proxy = Proc(proxy_argv + ["--prefill", p.url, "--decode", d.url], log_dir / "proxy.log", port)
            procs.append(proxy.wait_healthy(60))
            url = proxy.url
        t0 = time.monotonic()
        result = bench(args, url, log_dir / f"{name}.json")
        result["wall_s"] = time.monotonic() - t0
        if name == "disaggregated":
            metrics = httpx.get(procs[1].url + "/metrics", timeout=10).text
            result["pages_received"] = next(
                (float(line.split()[-1]) for line in metrics.splitlines() if 'direction="received"' in line), None
            )
            result["probe"] = probe(args, procs[0].url, procs[1].url)
        return result
    finally:
        for proc in reversed(procs):
            proc.stop()


def probe(args, prefill: str, decode: str) -> dict:
    """One request at a time, after the run: the prefill's answer (s), then the decode's first token
    from the pulled pages (s): what the transfer path adds. The decode server, asked plainly for a
    prompt of the same length, is the colocated TTFT beside it (its own prefill)."""
    out = {"prefill_s": [], "pull_to_first_token_s": [], "colocated_ttft_s": []}

    def first_token(url: str, body: dict) -> float:
        t0 = time.perf_counter()
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    return time.perf_counter() - t0
        raise RuntimeError(f"no token from {url}")

    for i in range(args.probe):
        ids = [40000 - 300 * i - j for j in range(args.input_len)]  # unlike the run's and each other's
        body = {"prompt": ids, "max_tokens": 4, "temperature": 0}
        t0 = time.perf_counter()
        answer = httpx.post(
            prefill + "/v1/completions",
            json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            timeout=300,
        ).json()
        out["prefill_s"].append(time.perf_counter() - t0)
        out["pull_to_first_token_s"].append(
            first_token(decode, {**body, "kv_transfer_params": answer["kv_transfer_params"]})
        )
        out["colocated_ttft_s"].append(first_token(decode, {**body, "prompt": [i + 11 for i in ids]}))
    return out


def row(name: str, r: dict) -> str:
    return (
        f"| {name} | {r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} "
        f"| {r['median_tpot_ms']:.0f} | {r['p99_tpot_ms']:.0f} | {r['request_goodput']:.2f} "
        f"| {100 * r['slo_attainment']:.0f}% | {r['completed']}/{r['completed'] + r['failed']} |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--setups", default="colocated,colocated-small,disaggregated")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=0.5)
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--probe", type=int, default=6, help="requests sent one at a time after the disaggregated run")
    p.add_argument("--small-chunk", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--slo-ttft", type=float, default=3000.0, help="ms")
    p.add_argument("--slo-tpot", type=float, default=250.0, help="ms")
    p.add_argument("--json", default=None, help="write every setup's result here")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-disagg-") as tmp:
        for name in args.setups.split(","):
            print(f"== {name}", flush=True)
            results[name] = run_setup(args, name, Path(tmp))
    print(
        f"\n{args.num_prompts} requests, {args.input_len} prompt / {args.output_len} output tokens, "
        f"{args.request_rate} req/s; SLO TTFT <= {args.slo_ttft:g} ms and TPOT <= {args.slo_tpot:g} ms\n"
    )
    print(
        "| setup | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | goodput req/s | within SLO | completed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(row(name, r))
    if "disaggregated" in results:
        r = results["disaggregated"]
        print(f"\npages pulled by the decode server: {r.get('pages_received')}")
        print(f"one request at a time ({args.probe} prompts of {args.input_len} tokens), median [min, max] s:")
        for key, values in r["probe"].items():
            v = sorted(values)
            print(f"  {key}: {v[len(v) // 2]:.3f} [{v[0]:.3f}, {v[-1]:.3f}]")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
