#!/usr/bin/env python
"""The step thread's CPU time per decode step at B running rows: the host's work, measured so that
other processes on a shared machine barely move it (scripts/bench_host_overhead.py times wall
clock, which a loaded 2-core machine inflates by 2x from run to run).

`time.thread_time()` of the thread that steps the engine (through `LLM.overlap`, as `LLM.generate`
does) counts what it computes and not what it waits for: scheduling, packing, dispatch, fetching and
unpacking the samples, detokenizing, stop checks, deltas; not the device's own threads. With
`--no-op-runner` the runner's execute is replaced by a stand-in that applies the step's update to the
running batch and samples token 7 for every row at once, leaving the engine core, the overlap wrapper
and the running batch alone.

    python scripts/bench_host_cpu.py --batch 64                  # the shipped small model
    python scripts/bench_host_cpu.py --batch 64 --no-op-runner
    PYTHONPATH=/tmp/before python scripts/bench_host_cpu.py ...   # another tree, same script
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # jaxserve from this checkout when not installed (PYTHONPATH goes first)
    sys.path.append(ROOT)


class NoOpPending:
    """What the runner's execute returns, without the model: token 7 for every sampling row."""

    def __init__(self, rows, batch):
        self.rows, self.shape, self.packed = rows, (batch, 8), self

    def sample_slots(self):
        return list(range(len(self.rows)))

    def is_ready(self):
        return True

    def wait(self):
        pass

    def result(self):
        from jaxserve.runner.step_io import StepSamples

        n = len(self.rows)
        return StepSamples(np.full((n, 1), 7, np.int32), np.asarray([int(r.samples) for r in self.rows], np.int32))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "checkpoints", "small"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-op-runner", action="store_true", help="time the engine core and the wrapper alone")
    args = ap.parse_args(argv)

    from jaxserve import LLM, SamplingParams

    B = args.batch
    with LLM(
        args.model,
        dtype="float32",
        page_size=16,
        max_model_len=1024,
        max_num_seqs=B,
        max_num_batched_tokens=2048,
        warm_up=False,
    ) as llm:
        engine = llm.engine
        if args.no_op_runner:
            runner = engine.runner
            if hasattr(runner, "batch"):  # the update is applied to the running batch (host work), not laid out
                runner.execute = lambda update: NoOpPending(runner.batch.apply(update), B)
            else:  # a tree from before the running batch: the core hands the rows whole
                runner.prepare_inputs = lambda rows, *_: rows
                runner.execute = lambda rows, logprobs=True: NoOpPending(rows, B)
        steps = getattr(llm, "overlap", None) or engine  # a tree from before the overlap wrapper: its core
        params = SamplingParams(max_tokens=args.steps * args.rounds + 100, temperature=0, ignore_eos=True)
        for i in range(B):
            engine.add_request(f"r{i}", None, params, list(range(10 + i, 60 + i)))
        for _ in range(20):  # the prompts, the decode bucket's first runs
            steps.step()
        rounds = []
        for _ in range(args.rounds):
            t = time.thread_time()
            for _ in range(args.steps):
                steps.step()
            rounds.append(1e6 * (time.thread_time() - t) / args.steps)
    result = {
        "batch": B,
        "no_op_runner": args.no_op_runner,
        "us_per_step": rounds,
        "median_us_per_step": statistics.median(rounds),
    }
    print(
        f"batch {B}, {'no-op' if args.no_op_runner else 'real'} runner: step thread CPU us/step per round "
        + " ".join(f"{x:.0f}" for x in rounds)
        + f"; median {result['median_us_per_step']:.0f}"
    )
    return result


if __name__ == "__main__":
    main()
