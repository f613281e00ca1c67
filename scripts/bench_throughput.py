"""Offline throughput: N requests through the engine at once, continuous or static batching.

Input and output lengths are drawn from a seeded distribution (`--mode fixed` or `mixed`); EOS is
ignored so every request produces exactly its drawn output length. Prints a summary and writes JSON.

    python scripts/bench_throughput.py --model configs/models/smollm2-135m --load-format dummy \
        --dtype bfloat16 --num-requests 128 --mode mixed --scheduling continuous --out out/tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


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
        engine.add_request(f"r{i}", prompt_token_ids=ids,
                           sampling_params=SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))
    utilisation, steps = [], 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML settings; flags override")
    EngineConfig.add_cli_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--mode", choices=("fixed", "mixed"), default="mixed")
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

    engine = LLMEngine(settings)
    prompts, out_lens = workload(args)
    result = dict(settings=settings.to_dict(), workload=dict(mode=args.mode, num_requests=args.num_requests,
                                                              input_tokens=sum(map(len, prompts)),
                                                              output_tokens=sum(out_lens)))
    result.update(run(engine, prompts, out_lens))
    print(json.dumps({k: v for k, v in result.items() if k != "settings"}, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
