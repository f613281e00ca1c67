"""Embeddings throughput through the server: a batch of short texts in one /v1/embeddings request
against the same texts sent one request at a time (issue 55's target: the batch at least 4x), and the
same texts as concurrent single requests. Starts `python -m jaxserve.serve --runner pooling` on the
model (default: the default model, SmolLM2-135M-Instruct: its embeddings mean nothing, its step costs
are the point), waits for it, warms both shapes once, then times each mode `--repeats` times
alternated and reports the best and median texts per second.

    python scripts/bench_embeddings.py --texts 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx

WORDS = (
    "the a of model server token batch page cache engine prompt text vector search query document "
    "answer question retrieval embedding jax step device host chunk row budget"
).split()


def short_texts(n: int, seed: int = 0) -> list[str]:
    """n short texts of 6 to 14 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(n)]


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "jaxserve.serve", *([args.model] if args.model else [])]
    cmd += ["--runner", "pooling", "--port", str(args.port), "--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--no-access-log"]
    log = open(args.log, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {args.log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise SystemExit(f"the server did not become healthy in {args.startup_timeout} s; see {args.log}")


def embed(client: httpx.Client, texts) -> dict:
    r = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"})
    r.raise_for_status()
    return r.json()


def batch(client, texts) -> float:
    start = time.perf_counter()
    out = embed(client, texts)
    assert len(out["data"]) == len(texts)
    return time.perf_counter() - start


def one_at_a_time(client, texts) -> float:
    start = time.perf_counter()
    for text in texts:
        embed(client, text)
    return time.perf_counter() - start


def concurrent(url, texts) -> float:
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
            start = time.perf_counter()
            responses = await asyncio.gather(
                *(client.post("/v1/embeddings", json={"input": t, "encoding_format": "base64"}) for t in texts)
            )
            assert all(r.status_code == 200 for r in responses)
            return time.perf_counter() - start

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--log", default="/tmp/bench_embeddings_server.log")
    parser.add_argument("--no-concurrent", action="store_true", help="skip the concurrent single requests")
    args = parser.parse_args()

    texts = short_texts(args.texts)
    proc, url = start_server(args)
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            tokens = embed(client, texts)["usage"]["prompt_tokens"]  # warm-up: every bucket the batch uses
            one_at_a_time(client, texts[:8])
            modes = {"batch": [], "one_at_a_time": [], **({} if args.no_concurrent else {"concurrent": []})}
            for _ in range(args.repeats):  # alternated, so a change of load on the machine hits both
                modes["batch"].append(batch(client, texts))
                modes["one_at_a_time"].append(one_at_a_time(client, texts))
                if not args.no_concurrent:
                    modes["concurrent"].append(concurrent(url, texts))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    rate = {m: [len(texts) / s for s in secs] for m, secs in modes.items()}
    result = {
        "texts": len(texts),
        "prompt_tokens": tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        **{f"{m}_texts_per_s_best": round(max(r), 1) for m, r in rate.items()},
        **{f"{m}_texts_per_s_median": round(statistics.median(r), 1) for m, r in rate.items()},
        "batch_over_one_at_a_time_median": round(
            statistics.median(rate["batch"]) / statistics.median(rate["one_at_a_time"]), 2
        ),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
