"""The prefix-aware router against Ray's default (`--router pow2`) on two replicas of the small model.

    python scripts/bench_prefix_routing.py [--routers prefix,pow2] [--json PATH]

For each router: a local Ray instance serves `jaxserve serve-ray --config small --model
checkpoints/small --num-replicas 2 --enable-prefix-caching --router R` in-process; GROUPS groups of
PER_GROUP streamed completions share a PREFIX-token prefix each (a random 1-40 token suffix). A
group's first request is sent alone (its prefix first seen, as a system prompt), then the rest,
shuffled across groups, at --concurrency; greedy, --max-tokens each. Reported: each group's share on
the replica that served most of it (the `x-jaxserve-replica` header), TTFT p50/p90 over the shuffled
requests, and per replica (`EngineReplica.stats`, called through the deployment handle until both
replicas answered) the share of the run's prompt tokens not prefilled (served from the prefix cache)
and the engine's cumulative `prefix_cache_hit_rate`.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

APP, ENGINE = "jaxserve", "JaxserveEngine"


def workload(args: argparse.Namespace) -> tuple[list, list]:
    """(firsts, rest): (group, prompt ids) pairs; `rest` shuffled across groups."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, 8000) for _ in range(args.prefix)] for _ in range(args.groups)]
    reqs = [
        (g, prefixes[g] + [rng.randrange(3, 8000) for _ in range(rng.randrange(1, 40))])
        for g in range(args.groups)
        for _ in range(args.per_group)
    ]
    rest = [r for i, r in enumerate(reqs) if i % args.per_group]
    rng.shuffle(rest)
    return reqs[:: args.per_group], rest


def stream(client: httpx.Client, model: str, ids: list[int], max_tokens: int) -> tuple[str, float, int]:
    """(replica, TTFT in s, completion tokens) of one streamed completion."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0, ttft, tokens = time.perf_counter(), None, 0
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()!r}")
        replica = r.headers.get("x-jaxserve-replica", "?")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices") and event["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return replica, ttft if ttft is not None else time.perf_counter() - t0, tokens


def replica_stats(handle, n: int = 2, tries: int = 60) -> dict[str, dict]:
    """{replica id: its engine's stats}: `stats` called until n replicas answered (the router picks)."""
    seen: dict[str, dict] = {}
    for _ in range(tries):
        s = handle.stats.remote().result()
        seen[s["replica"]] = s
        if len(seen) >= n:
            break
    return seen


def run_router(router: str, args: argparse.Namespace, url: str) -> dict:
    from ray import serve

    from jaxserve.serving.ray.cli import build_parser, spec_from_namespace
    from jaxserve.serving.ray.deployments import build_application

    flags = [
        "--config",
        "small",
        "--model",
        args.model,
        "--num-replicas",
        "2",
        "--enable-prefix-caching",
        "--router",
        router,
    ]
    spec = spec_from_namespace(build_parser().parse_args(flags))
    t0 = time.perf_counter()
    serve.run(build_application(spec), name=APP, route_prefix="/")
    startup = time.perf_counter() - t0
    handle = serve.get_deployment_handle(ENGINE, app_name=APP)
    before = replica_stats(handle)
    firsts, rest = workload(args)
    with httpx.Client(base_url=url, timeout=300) as client:
        first = [(g, *stream(client, spec.model_name, ids, args.max_tokens)) for g, ids in firsts]
        with ThreadPoolExecutor(args.concurrency) as pool:
            shuffled = list(pool.map(lambda r: (r[0], *stream(client, spec.model_name, r[1], args.max_tokens)), rest))
    after = replica_stats(handle)
    serve.delete(APP)
    by_group = collections.defaultdict(collections.Counter)
    for g, replica, _, _ in first + shuffled:
        by_group[g][replica] += 1
    ttfts = sorted(t for _, _, t, _ in shuffled)
    q = statistics.quantiles(ttfts, n=10)
    replicas = {}
    for rid, s in after.items():
        b = before.get(rid, {})
        prompt = s["prompt_tokens_total"] - b.get("prompt_tokens_total", 0)
        computed = s["prefill_tokens_computed"] - b.get("prefill_tokens_computed", 0)
        replicas[rid] = {
            "requests": sum(c[rid] for c in by_group.values()),
            "prompt_tokens": prompt,
            "prefilled_tokens": computed,
            "cached_share": 1 - computed / prompt if prompt else None,
            "engine_prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
        }
    return {
        "router": router,
        "startup_s": round(startup, 1),
        "group_top_share": [
            round(by_group[g].most_common(1)[0][1] / sum(by_group[g].values()), 3) for g in sorted(by_group)
        ],
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p90_ms": round(1000 * q[8], 1),
        "mean_completion_tokens": round(statistics.mean(t for *_, t in first + shuffled), 1),
        "replicas_seen_in_stats": len(after),
        "replicas": replicas,
    }


def table(results: list[dict]) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    lines = [
        "| router | requests of a group on its top replica | TTFT p50 | TTFT p90 | prompt tokens from the "
        "prefix cache, per replica (requests) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        reps = ", ".join(f"{pct(v['cached_share'])} ({v['requests']})" for v in r["replicas"].values())
        if r["replicas_seen_in_stats"] < 2:
            reps += " (stats reached only one replica)"
        lines.append(
            f"| {r['router']} | {', '.join(pct(s) for s in r['group_top_share'])} | "
            f"{r['ttft_p50_ms']:.0f} ms | {r['ttft_p90_ms']:.0f} ms | {reps} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--routers", default="prefix,pow2")
    p.add_argument("--model", default="checkpoints/small")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix", type=int, default=512, help="shared prefix length in tokens")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout)")
    args = p.parse_args()

    import ray
    from ray import serve

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # 4 logical CPUs: two engine replicas of one CPU each and the ingress fit on a 2-core machine.
    ray.init(
        num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}}
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        results = [run_router(r, args, f"http://127.0.0.1:{port}") for r in args.routers.split(",")]
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json == "-":
        print(json.dumps(results, indent=2))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
