"""`jaxserve bench latency` and `jaxserve bench throughput`: the engine alone, through `LLM.generate`.

    jaxserve bench latency [engine flags] --input-len 32 --output-len 128 --batch-size 8
    jaxserve bench throughput [engine flags] --num-prompts 200 --input-len 256 --output-len 128

As vLLM's commands of these names: latency times one batch end to end, again and again, and reports
the mean and percentiles; throughput sends every prompt at once and reports requests/s and tokens/s.
The engine takes the flags and `--config` of `jaxserve serve` (with neither `--model` nor `--config`,
the default model with configs/default.yaml), so an offline figure and a served one use the same
settings. Prompts are random token ids, fresh in every iteration: a repeated prompt would be served
from the prefix cache and time no prefill. Outputs run to max_tokens (EOS ignored) so every iteration
does the same work. Start-up (loading, compiling) is not timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from typing import Any, Sequence

import numpy as np

from jaxserve.bench import datasets
from jaxserve.bench.metrics import percentile
from jaxserve.config import EngineConfig
from jaxserve.errors import JaxServeError
from jaxserve.loading import resources

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def _engine_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML of engine settings or a shipped config's name, as `jaxserve serve --config`; "
        "default: configs/default.yaml when no --model is given",
    )
    EngineConfig.add_cli_arguments(p, title_prefix="engine: ")
    return p


def build_latency_parser(prog: str = "jaxserve bench latency") -> argparse.ArgumentParser:
    p = _engine_parser(prog, "Offline latency: one batch through LLM.generate, end to end, repeated.")
    b = p.add_argument_group("benchmark")
    b.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    b.add_argument("--output-len", type=int, default=128, help="generated tokens per prompt")
    b.add_argument("--batch-size", type=int, default=8, help="prompts per batch")
    b.add_argument("--num-iters-warmup", type=int, default=10, help="untimed batches first")
    b.add_argument("--num-iters", type=int, default=30, help="timed batches")
    b.add_argument("--output-json", default=None, help="write the result here")
    b.add_argument("--disable-tqdm", action="store_true")
    return p


def build_throughput_parser(prog: str = "jaxserve bench throughput") -> argparse.ArgumentParser:
    p = _engine_parser(prog, "Offline throughput: every prompt at once through LLM.generate.")
    b = p.add_argument_group("benchmark")
    b.add_argument(
        "--dataset-name",
        default="random",
        choices=("random", "chat"),
        help="random: token ids of --input-len; chat: the built-in chat-like conversations (LLM.chat)",
    )
    b.add_argument("--num-prompts", type=int, default=200)
    b.add_argument("--input-len", type=int, default=256, help="random: prompt tokens (chat: median words)")
    b.add_argument("--output-len", type=int, default=128, help="random: generated tokens (chat: median)")
    b.add_argument("--random-range-ratio", type=float, default=0.0, help="random: lengths in len*(1 +- this)")
    b.add_argument("--output-json", default=None, help="write the result here")
    b.add_argument("--disable-tqdm", action="store_true")
    return p


def engine_settings(ns: argparse.Namespace) -> EngineConfig:
    """Flags over --config over nothing, as `jaxserve serve` reads them (no model and no config: the default)."""
    config = resources.resolve_config(ns.config) if ns.config else None
    if config is None and getattr(ns, "model", None) is None and resources.shipped_config("default").is_file():
        config = str(resources.shipped_config("default"))
    settings = EngineConfig.from_namespace(ns, config)
    return settings.replace(tokenizer=resources.resolve_shipped_path(settings.tokenizer))


def build_llm(settings: EngineConfig):
    from jaxserve.llm import LLM  # builds the engine: jax

    values = settings.to_dict()
    return LLM(values.pop("model"), **values)


def _ids(rng: np.random.Generator, vocab: int, n: int, length: int) -> list[list[int]]:
    return rng.integers(min(10, vocab - 1), vocab, (n, length)).tolist()


def run_latency(llm: Any, args: argparse.Namespace) -> dict:
    from jaxserve.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    rng = np.random.default_rng(args.seed)
    vocab = llm.model_config.vocab_size

    def once() -> float:
        prompts = _ids(rng, vocab, args.batch_size, args.input_len)
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return time.perf_counter() - start

    from tqdm import tqdm

    for _ in tqdm(range(args.num_iters_warmup), desc="warm-up", disable=args.disable_tqdm):
        once()
    latencies = [once() for _ in tqdm(range(args.num_iters), desc="timed", disable=args.disable_tqdm)]
    return {
        "avg_latency": sum(latencies) / len(latencies),
        "latencies": latencies,
        "percentiles": {str(q): percentile(latencies, q) for q in LATENCY_PERCENTILES},
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup,
    }


def run_throughput(llm: Any, args: argparse.Namespace) -> dict:
    from jaxserve.sampling.params import SamplingParams

    if args.dataset_name == "chat":
        requests = datasets.chat_requests(args.num_prompts, args.input_len, args.output_len, args.seed)
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in requests]
        start = time.perf_counter()
        outputs = llm.chat([r.prompt for r in requests], params, use_tqdm=not args.disable_tqdm)
    else:
        vocab = llm.model_config.vocab_size
        requests = datasets.random_requests(
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.random_range_ratio,
            seed=args.seed,
            token_low=min(10, vocab - 1),
            token_high=vocab,
        )
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in requests]
        start = time.perf_counter()
        outputs = llm.generate(
            prompt_token_ids=[r.prompt for r in requests], sampling_params=params, use_tqdm=not args.disable_tqdm
        )
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": prompt_tokens + output_tokens,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "dataset_name": args.dataset_name,
    }


def _finish(result: dict, settings: EngineConfig, args: argparse.Namespace) -> None:
    import jax

    result.update(
        date=datetime.now().strftime("%Y%m%d-%H%M%S"),
        model=settings.model,
        device=str(jax.devices()[0].device_kind),
        jax_version=jax.__version__,
        settings=settings.to_dict(),
    )
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, default=str)


def _run(kind: str, argv: Sequence[str] | None, prog: str) -> int:
    parser = build_latency_parser(prog) if kind == "latency" else build_throughput_parser(prog)
    args = parser.parse_args(argv)
    sizes = ("input_len", "output_len", "batch_size", "num_iters", "num_prompts")
    for name in sizes:
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        settings = engine_settings(args)
        args.seed = settings.seed  # the engine's --seed draws the prompts too
        llm = build_llm(settings)
    except JaxServeError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    with llm as engine:
        result = run_latency(engine, args) if kind == "latency" else run_throughput(engine, args)
    _finish(result, settings, args)
    if kind == "latency":
        print(f"Avg latency: {result['avg_latency']:.4f} seconds")
        for q, value in result["percentiles"].items():
            print(f"{q}% percentile latency: {value:.4f} seconds")
    else:
        print(
            f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} "
            f"total tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s "
            f"({result['num_requests']} requests in {result['elapsed_time']:.2f} s)"
        )
    return 0


def latency_main(argv: Sequence[str] | None = None, prog: str = "jaxserve bench latency") -> int:
    return _run("latency", argv, prog)


def throughput_main(argv: Sequence[str] | None = None, prog: str = "jaxserve bench throughput") -> int:
    return _run("throughput", argv, prog)
