"""`jaxserve bench serve`: vLLM's `vllm bench serve` against any OpenAI-compatible server.

    jaxserve bench serve --base-url http://127.0.0.1:8000 --dataset-name random --random-input-len 128 \\
        --random-output-len 128 --num-prompts 200 --request-rate 4 --max-concurrency 16 \\
        --goodput ttft:1000 tpot:100 --save-result

The flags, defaults and result keys are vLLM's where jaxserve has the same thing, so a command line and
a result file carry over; what differs: `--dataset-name chat` (a built-in chat-like set, no download)
and `sharegpt` (a local file only), random prompts sent as token ids to /v1/completions (exact lengths
without a client tokenizer; words to a chat endpoint) and token counts from the server's `usage`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from datetime import datetime
from typing import Any, Sequence

from jaxserve.bench import datasets
from jaxserve.bench.http import Client
from jaxserve.bench.loadgen import first_model, run_load, wait_until_ready
from jaxserve.bench.metrics import METRICS, parse_goodput, percentile_key, summarize

BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "errors")


def rate(text: str) -> float:
    value = float("inf") if text.strip().lower() == "inf" else float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("the request rate must be a positive number or inf")
    return value


def token_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH token ids, got {text!r}") from None
    if not 0 <= low < high:
        raise argparse.ArgumentTypeError(f"need 0 <= LOW < HIGH, got {text!r}")
    return low, high


def build_parser(prog: str = "jaxserve bench serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    s = p.add_argument_group("server")
    s.add_argument(
        "--backend",
        default="openai",
        choices=tuple(BACKENDS),
        help="openai (= vllm): /v1/completions; openai-chat: /v1/chat/completions",
    )
    s.add_argument("--base-url", default=None, help="the server's URL; default http://HOST:PORT")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--endpoint", default=None, choices=sorted(set(BACKENDS.values())), help="default: the --backend's")
    s.add_argument("--model", default=None, help="the name requests carry; default: the first of GET /v1/models")
    s.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)",
    )
    s.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=600.0,
        help="wait this long for the server to be ready (/health) before sending",
    )
    s.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    d = p.add_argument_group("dataset")
    d.add_argument(
        "--dataset-name",
        default="random",
        choices=("random", "chat", "sharegpt"),
        help="random: token ids of chosen lengths; chat: built-in seeded chat-like conversations; "
        "sharegpt: a local ShareGPT JSON (--dataset-path)",
    )
    d.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file (--dataset-name sharegpt)")
    d.add_argument("--num-prompts", type=int, default=1000)
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- this)")
    d.add_argument("--random-prefix-len", type=int, default=0, help="a prefix of this many tokens on every prompt")
    d.add_argument(
        "--random-token-range",
        type=token_range,
        default=(10, 250),
        metavar="LOW:HIGH",
        help="random prompts' token ids (within every vocabulary you will compare)",
    )
    d.add_argument("--chat-input-len", type=int, default=96, help="chat: median words of a user request")
    d.add_argument("--chat-output-len", type=int, default=128, help="chat: median max_tokens")
    d.add_argument("--sharegpt-output-len", type=int, default=None, help="sharegpt: max_tokens of every request")
    t = p.add_argument_group("traffic")
    t.add_argument(
        "--request-rate",
        type=rate,
        default=float("inf"),
        help="requests/s (arrivals a Poisson process, or gamma with --burstiness), or inf: all at once",
    )
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals: 1 Poisson, <1 burstier")
    t.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    t.add_argument("--num-warmups", type=int, default=0, help="requests sent one by one first, not measured")
    t.add_argument("--ignore-eos", action="store_true", help="generate max_tokens whatever the model says")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("results")
    r.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el; milliseconds)",
    )
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"of {','.join(METRICS)}")
    r.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 25,50,90,99")
    r.add_argument("--save-result", action="store_true", help="write the result as JSON")
    r.add_argument("--save-detailed", action="store_true", help="with per-request lengths, TTFTs, ITLs and errors")
    r.add_argument("--result-dir", default=".", help="where --save-result writes")
    r.add_argument("--result-filename", default=None, help="default: BACKEND-RATEqps-concurrencyN-MODEL-DATE.json")
    r.add_argument("--label", default=None, help="a name for this run in the result (default: the backend)")
    r.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="extra fields of the result")
    r.add_argument("--disable-tqdm", action="store_true")
    return p


def checked(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """Everything a flag can get wrong, as a parser error (exit 2) before anything is sent."""
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if not metrics or any(m not in METRICS for m in metrics):
        parser.error(f"--percentile-metrics takes names of {', '.join(METRICS)}, got {args.percentile_metrics!r}")
    try:
        percentiles = [float(q) for q in args.metric_percentiles.split(",") if q.strip()]
    except ValueError:
        parser.error(f"--metric-percentiles takes numbers, got {args.metric_percentiles!r}")
    if not percentiles or any(not 0 <= q <= 100 for q in percentiles):
        parser.error("--metric-percentiles must be numbers from 0 to 100")
    try:
        goodput = parse_goodput(args.goodput)
    except ValueError as err:
        parser.error(str(err))
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        parser.error("--dataset-name sharegpt needs --dataset-path FILE (nothing is downloaded)")
    if args.burstiness <= 0:
        parser.error("--burstiness must be positive")
    metadata = {}
    for item in args.metadata or ():
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--metadata takes KEY=VALUE, got {item!r}")
        metadata[key] = value
    return {"metrics": metrics, "percentiles": percentiles, "goodput": goodput, "metadata": metadata}


def make_requests(args: argparse.Namespace, endpoint: str, run: int | str = 0) -> list[datasets.SampleRequest]:
    n = args.num_prompts
    if args.dataset_name == "chat":
        return datasets.chat_requests(n, args.chat_input_len, args.chat_output_len, args.seed, run)
    if args.dataset_name == "sharegpt":
        return datasets.sharegpt_requests(args.dataset_path, n, args.seed, args.sharegpt_output_len)
    low, high = args.random_token_range
    return datasets.random_requests(
        n,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.random_prefix_len,
        args.seed,
        run,
        text=endpoint.endswith("chat/completions"),
        token_low=low,
        token_high=high,
    )


def result_filename(args: argparse.Namespace, model: str, date: str) -> str:
    rate_text = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(model.rstrip("/")) or "model")
    return f"{args.backend}-{rate_text}qps-concurrency{args.max_concurrency or 'inf'}-{name}-{date}.json"


async def benchmark(args: argparse.Namespace, options: dict) -> dict:
    """Wait for the server, warm up, send the load; the result dict (vLLM's keys)."""
    endpoint = args.endpoint or BACKENDS[args.backend]
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    requests = make_requests(args, endpoint)
    body_options = dict(ignore_eos=args.ignore_eos, temperature=args.temperature)
    async with Client(base_url, headers, timeout=args.timeout) as client:
        await wait_until_ready(client, args.ready_check_timeout_sec)
        model = args.model or await first_model(client)
        if args.num_warmups:
            warm = make_requests(
                argparse.Namespace(**{**vars(args), "num_prompts": args.num_warmups}), endpoint, run="warm-up"
            )
            await run_load(
                client, warm, endpoint, model, float("inf"), max_concurrency=1, timeout=args.timeout, **body_options
            )
        bar = None
        if not args.disable_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="requests", unit="req")
        results, duration = await run_load(
            client,
            requests,
            endpoint,
            model,
            args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            seed=args.seed + 1,
            timeout=args.timeout,
            on_done=(lambda _: bar.update(1)) if bar is not None else None,
            **body_options,
        )
        if bar is not None:
            bar.close()
    summary = summarize(results, duration, options["percentiles"], options["metrics"], options["goodput"])
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "label": args.label or args.backend,
        "model_id": model,
        "base_url": base_url,
        "endpoint": endpoint,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "goodput_slo_ms": options["goodput"] or None,
        **options["metadata"],
        **summary,
    }
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        result["error_kinds"] = errors[:10]
    if args.save_detailed:
        result.update(
            input_lens=[r.input_len for r in results],
            output_lens=[r.output_tokens for r in results],
            ttfts=[r.ttft for r in results],
            itls=[r.itl for r in results],
            errors=[r.error for r in results],
        )
    return result


def report(result: dict, metrics: Sequence[str], percentiles: Sequence[float]) -> str:
    """The console summary, laid out as vLLM's."""
    rows = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
        ("Maximum request concurrency:", result["max_concurrency"]),
        ("Benchmark duration (s):", f"{result['duration']:.2f}"),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", f"{result['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"),
    ]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines += [f"{k:<40}{v}" for k, v in rows]
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for m in metrics:
        lines.append("{s:{c}^{n}}".format(s=titles[m], n=50, c="-"))
        name = m.upper()
        lines.append(f"{f'Mean {name} (ms):':<40}{result[f'mean_{m}_ms']:.2f}")
        lines.append(f"{f'Median {name} (ms):':<40}{result[f'median_{m}_ms']:.2f}")
        for q in percentiles:
            lines.append(f"{f'P{q:g} {name} (ms):':<40}{result[percentile_key(m, q)]:.2f}")
    for err in result.get("error_kinds", []):
        lines.append(f"error: {err}")
    lines.append("=" * 50)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "jaxserve bench serve") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    options = checked(args, parser)
    started = time.time()
    try:
        result = asyncio.run(benchmark(args, options))
    except (TimeoutError, ConnectionError, OSError, ValueError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    print(report(result, options["metrics"], options["percentiles"]))
    if args.save_result or args.result_filename:
        path = os.path.join(
            args.result_dir, args.result_filename or result_filename(args, result["model_id"], result["date"])
        )
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path} ({time.time() - started:.0f} s)")
    return 0 if result["completed"] else 1
