"""Offline throughput: N requests through the engine at once, continuous or static batching.

Input and output lengths are drawn from a seeded distribution (`--mode fixed` or `mixed`); EOS is
ignored so every request produces exactly its drawn output length. Prints a summary and writes JSON.
`--compare continuous,static` runs the same workload under both schedulers in one process and
reports the ratio; `--mode shared-prefix` measures TTFT of requests sharing a `--prefix-len` prefix,
sent one at a time, with prefix caching on and off (`--compare prefix-caching`).

    python scripts/bench_throughput.py --model configs/models/smollm2-135m --load-format dummy \
        --dtype bfloat16 --num-requests 128 --mode mixed --compare continuous,static --out out/tp.json
    python scripts/bench_throughput.py --model configs/models/smollm2-135m --load-format dummy \
        --dtype bfloat16 --mode shared-prefix --prefix-len 512 --num-requests 8 --compare prefix-caching
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.overlap import Overlap
from jaxserve.llm_engine import LLMEngine
from jaxserve.sampling.params import SamplingParams


def workload(args) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(args.workload_seed)
    n = args.num_requests
    if args.mode == "fixed":
        in_lens = np.full(n, args.input_len)
        out_lens = np.full(n, args.output_len)
    else:
        in_lens = rng.integers(args.min_input, args.max_input + 1, n)
        out_lens = rng.integers(args.min_output, args.max_output + 1, n)
    prompts = [rng.integers(1, args.vocab_limit, int(k)).tolist() for k in in_lens]
    return prompts, [int(k) for k in out_lens]


def run(engine: LLMEngine, prompts: list[list[int]], out_lens: list[int]) -> dict:
    for i, (ids, k) in enumerate(zip(prompts, out_lens)):
        engine.add_request(
            f"r{i}", prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)
        )
    utilisation, steps, overlap = [], 0, Overlap(engine)  # async scheduling's steps in flight, as LLM.generate
    start = time.perf_counter()
    while overlap.has_unfinished_requests():
        overlap.step()
        steps += 1
        utilisation.append(float(np.mean(engine.stats()["kv_cache_utilization"])))
    elapsed = time.perf_counter() - start
    out_tokens, in_tokens = sum(out_lens), sum(len(p) for p in prompts)
    return dict(
        seconds=elapsed,
        steps=steps,
        requests_per_s=len(prompts) / elapsed,
        output_tokens_per_s=out_tokens / elapsed,
        total_tokens_per_s=(out_tokens + in_tokens) / elapsed,
        mean_kv_utilisation=float(np.mean(utilisation)) if utilisation else 0.0,
        preemptions=engine.scheduler.num_preemptions,
    )


def shared_prefix_ttft(engine: LLMEngine, args) -> dict:
    """TTFT of requests sharing one prefix, sent one at a time (the first one fills the cache)."""
    rng = np.random.default_rng(args.workload_seed)
    prefix = rng.integers(1, args.vocab_limit, args.prefix_len).tolist()
    ttfts, prefilled, overlap = [], [], Overlap(engine)
    for i in range(args.num_requests):
        suffix = rng.integers(1, args.vocab_limit, args.input_len).tolist()
        before = engine.counters["prefill_tokens_computed"]
        start = time.perf_counter()
        engine.add_request(
            f"p{i}",
            prompt_token_ids=prefix + suffix,
            sampling_params=SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        )
        while overlap.has_unfinished_requests():
            overlap.step()
        ttfts.append(time.perf_counter() - start)
        prefilled.append(engine.counters["prefill_tokens_computed"] - before)
    later = ttfts[1:] or ttfts
    return dict(
        first_ttft_s=ttfts[0],
        mean_ttft_s_after_first=float(np.mean(later)),
        median_ttft_s_after_first=float(np.median(later)),
        prefilled_tokens=prefilled,
    )


def run_once(settings: EngineConfig, args, prompts, out_lens) -> dict:
    engine = LLMEngine(settings)
    if args.mode == "shared-prefix":
        return shared_prefix_ttft(engine, args)
    return run(engine, prompts, out_lens)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML settings; flags override")
    EngineConfig.add_cli_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--mode", choices=("fixed", "mixed", "shared-prefix"), default="mixed")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix mode: prefix tokens")
    parser.add_argument(
        "--compare",
        choices=("continuous,static", "prefix-caching"),
        default=None,
        help="run twice in this process (continuous vs static scheduling, or prefix caching "
        "on vs off) and report the ratio",
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-input", type=int, default=32)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=512)
    parser.add_argument("--vocab-limit", type=int, default=1000, help="prompt token ids are drawn below this")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the lengths and prompts")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    values = EngineConfig.cli_values(args)
    settings = EngineConfig.from_yaml(args.config, values) if args.config else EngineConfig.from_dict(values)

    prompts, out_lens = workload(args)
    result = dict(
        settings=settings.to_dict(),
        workload=dict(
            mode=args.mode,
            num_requests=args.num_requests,
            input_tokens=sum(map(len, prompts)),
            output_tokens=sum(out_lens),
        ),
    )
    if args.compare is None:
        result.update(run_once(settings, args, prompts, out_lens))
    elif args.compare == "continuous,static":
        runs = {
            mode: run_once(settings.replace(scheduling=mode), args, prompts, out_lens)
            for mode in ("continuous", "static")
        }
        result.update(
            runs=runs,
            continuous_over_static_output_tokens_per_s=(
                runs["continuous"]["output_tokens_per_s"] / runs["static"]["output_tokens_per_s"]
            ),
        )
    else:
        runs = {
            name: run_once(settings.replace(enable_prefix_caching=on), args, prompts, out_lens)
            for name, on in (("prefix_caching_on", True), ("prefix_caching_off", False))
        }
        result.update(
            runs=runs,
            ttft_off_over_on=(
                runs["prefix_caching_off"]["mean_ttft_s_after_first"]
                / runs["prefix_caching_on"]["mean_ttft_s_after_first"]
            ),
        )
    print(json.dumps({k: v for k, v in result.items() if k != "settings"}, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
