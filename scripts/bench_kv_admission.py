"""Continuous against static batching at equal KV memory: how many steps each needs, against the bound.

Both engines get the same page pool (default 512 pages of 16 tokens: 8,192 tokens). Static batching
reserves prompt + max_tokens per sequence at admission (`preemption_mode="reserve"`) and admits only
into an empty batch; continuous batching admits by the pages a prompt needs now (`max_num_seqs` 64,
so memory binds) and preempts by recompute when decodes run out of pages. The workload is issue 4's
mixed one (`bench_throughput.workload`: 128 requests, inputs U[32, 256], outputs U[16, 512], seed 0,
EOS ignored).

Step counts are a property of the scheduler, not of the model, so by default the runner is replaced
by one that computes nothing (every row samples token 1): the real `LLMEngine` bookkeeping (scheduler,
block manager, preemption, prefix cache, token accounting) runs unchanged, in seconds. `--real` runs
the model instead (slow: every step is a real ragged step on this CPU).

The bound on continuous steps: each request occupies pool tokens for its whole decode, on average
input + output / 2 of them for `output` steps, so a pool of M tokens needs at least
sum(output * (input + output / 2)) / M steps, and never fewer than the longest output.

    python scripts/bench_kv_admission.py --out out/kv_admission.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

from jaxserve.llm_engine import LLMEngine
from jaxserve.runner.step_io import StepSamples
from jaxserve.sampling.params import SamplingParams


class NoComputeStep:
    """What `ModelRunner.execute` returns, without running the model: token 1 for every row."""

    def __init__(self, rows):
        self.rows = rows
        self.shape = (16, 1)
        self.packed = self

    def sample_slots(self):
        return list(range(len(self.rows)))

    def is_ready(self):
        return True

    def wait(self):
        pass

    def result(self):
        n = len(self.rows)
        return StepSamples(np.ones((n, 1), np.int32), np.asarray([int(r.samples) for r in self.rows], np.int32))


def skip_compute(runner) -> None:
    """Make the runner's steps return token 1 for every row without running the model."""
    runner.execute = lambda update: NoComputeStep(runner.batch.apply(update))


def run(engine: LLMEngine, prompts, out_lens) -> dict:
    for i, (ids, k) in enumerate(zip(prompts, out_lens)):
        engine.add_request(
            f"r{i}", prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)
        )
    steps, running, start = 0, [], time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        running.append(len(engine.scheduler.running))
    return dict(
        steps=steps,
        seconds=time.perf_counter() - start,
        preemptions=engine.scheduler.num_preemptions,
        mean_running=float(np.mean(running)),
        max_running=int(max(running)),
        steps_by_kind=engine.stats()["steps_by_kind"],
    )


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def main(argv=None) -> dict:
    from bench_decode import git_state  # scripts/ is on sys.path when run as a script
    from bench_throughput import workload

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="configs/models/smollm2-135m")
    parser.add_argument("--num-pages", type=int, default=512, help="usable pages (one more is the padding page)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--real", action="store_true", help="run the model (slow) instead of the no-compute runner")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    wl = argparse.Namespace(
        workload_seed=0,
        num_requests=args.num_requests,
        mode="mixed",
        min_input=32,
        max_input=256,
        min_output=16,
        max_output=512,
        vocab_limit=1000,
    )
    prompts, out_lens = workload(wl)
    pool = args.num_pages * args.page_size
    bound = max(sum(k * (len(p) + k / 2) for p, k in zip(prompts, out_lens)) / pool, max(out_lens))
    base = dict(
        model=args.model,
        load_format="dummy",
        dtype="float32",
        page_size=args.page_size,
        num_pages=args.num_pages + 1,
        max_model_len=1024,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        compilation_cache_dir="none",
    )
    modes = {
        "continuous": dict(scheduling="continuous", preemption_mode="recompute", max_num_seqs=args.max_num_seqs),
        "static": dict(scheduling="static", preemption_mode="reserve", max_num_seqs=args.max_num_seqs),
    }
    from jaxserve.config import EngineConfig

    results = {}
    for name, mode in modes.items():
        engine = LLMEngine(EngineConfig.from_dict({**base, **mode}), warm_up=args.real)
        if not args.real:
            skip_compute(engine.runner)
        results[name] = run(engine, prompts, out_lens)
        engine.close()
        print(f"{name}: {results[name]}", flush=True)
    commit, dirty = git_state(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    report = dict(
        date=time.strftime("%Y-%m-%d"),
        cpu=cpu_name(),
        commit=commit,
        jaxserve_dirty=dirty,
        pool_tokens=pool,
        requests=len(prompts),
        output_tokens=sum(out_lens),
        real_model=args.real,
        lower_bound_steps=math.ceil(bound),
        **results,
        continuous_over_bound=results["continuous"]["steps"] / bound,
        static_over_continuous_steps=results["static"]["steps"] / results["continuous"]["steps"],
    )
    print(json.dumps({k: v for k, v in report.items() if k not in modes}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
