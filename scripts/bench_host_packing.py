"""Host time per engine step to build what the caller gets, against the output length so far.

Runs only the host side (no model, no device): B requests of one running sample each, whose outputs
already hold T tokens (with top-5 logprobs when asked); each timed "step" appends one token per
request and builds every request's output through the engine's OutputProcessor, as
`LLMEngine._finish_step` does. Since the engine emits deltas (issue 22, item 3) the cost should not
grow with T; before, each step copied every request's whole output (ids, logprob entries).
Works on older commits too (it calls `OutputProcessor.output` there, the cumulative form).

    python scripts/bench_output_emit.py --batches 16,64 --lengths 16,256,1024 --logprobs 0,5
"""

from __future__ import annotations

import argparse
from array import array
import json
import platform
import subprocess
import time

import timeit

from jaxserve.engine.output_processor import OutputProcessor, Request
from jaxserve.engine.sequence import Sequence, Status
from jaxserve.model.ragged import RaggedRow, pack_ragged
from jaxserve.model.sampler import RowSampling, SamplingTensors
from jaxserve.sampling.params import SamplingParams

PAGE_SIZE = 16


def time_packing(batch: int, context: int) -> float:
    """us per pack_ragged call of `batch` decode rows at `context` tokens (the default config's shape)."""
    pages = -(-context // PAGE_SIZE)
    rows = [
        RaggedRow([7 + i], context - 1, array("i", range(1 + i * pages, 1 + (i + 1) * pages)))  # as page_ids
        for i in range(batch)
    ]
    shape = dict(
        page_size=PAGE_SIZE,
        num_tokens=max(4, 1 << (batch - 1).bit_length()),
        num_rows=64,
        max_pages=pages,
        num_logits=64,
    )
    return min(timeit.repeat(lambda: pack_ragged(rows, **shape), number=50, repeat=7)) / 50 * 1e6


def time_sampling_rows(batch: int) -> tuple[float, float]:
    """(us per RowSampling.from_params, us per SamplingTensors.pack of `batch` rows)."""
    params = SamplingParams(max_tokens=100, temperature=0.7, top_p=0.9)
    prompt, output = list(range(100)), list(range(50))
    build = lambda: RowSampling.from_params(params, seed=1, step=50, prompt_ids=prompt, output_ids=output)  # noqa: E731
    rows = [build() for _ in range(batch)]
    per_row = min(timeit.repeat(build, number=2000, repeat=5)) / 2000 * 1e6
    pack = min(timeit.repeat(lambda: SamplingTensors.pack(rows, (1, max(batch, 16))), number=200, repeat=5)) / 200 * 1e6
    return per_row, pack


def make_requests(batch: int, length: int, logprobs: int | None) -> list[Request]:
    params = SamplingParams(max_tokens=10**6, ignore_eos=True, logprobs=logprobs)
    requests = []
    for i in range(batch):
        seq = Sequence(f"s{i}", f"r{i}", 0, list(range(8)), params, seed=i, status=Status.RUNNING)
        for k in range(length):
            seq.output_token_ids.append(5 + k % 100)
            seq.text += "x"
            if logprobs is not None:
                seq.logprobs.append({5 + k % 100 + j: -0.1 * j for j in range(logprobs + 1)})
        seq.ids_emitted = seq.text_emitted = length  # ignored by the cumulative form
        requests.append(Request(f"r{i}", None, seq.prompt_token_ids, params, [seq], time.monotonic()))
    return requests


def time_steps(batch: int, length: int, logprobs: int | None, steps: int) -> float:
    processor = OutputProcessor(None, (0,), 10**7)
    build = getattr(processor, "delta", None) or processor.output
    requests = make_requests(batch, length, logprobs)
    start = time.perf_counter()
    for _ in range(steps):
        for request in requests:
            seq = request.seqs[0]
            seq.output_token_ids.append(7)
            seq.text += "y"
            if logprobs is not None:
                seq.logprobs.append({7: -0.1})
            build(request)
    return (time.perf_counter() - start) / steps * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="128,1024", help="packing: tokens per row")
    ap.add_argument("--lengths", default="16,1024", help="outputs: tokens already in each output")
    ap.add_argument("--logprobs", default="none,5", help="comma list: none (not asked) or top-N")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}  {platform.processor() or platform.machine()}  {time.strftime('%Y-%m-%d %H:%M')}")
    packing = []
    print(f"{'batch':>5} {'context':>7} {'pack us':>8}")
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            us = time_packing(batch, context)
            packing.append(dict(batch=batch, context=context, us_per_step=us))
            print(f"{batch:5d} {context:7d} {us:8.0f}")
    sampling = []
    print(f"{'batch':>5} {'from_params us/row':>18} {'SamplingTensors.pack us':>23}")
    for batch in map(int, args.batches.split(",")):
        per_row, pack = time_sampling_rows(batch)
        sampling.append(dict(batch=batch, from_params_us_per_row=per_row, pack_us=pack))
        print(f"{batch:5d} {per_row:18.1f} {pack:23.0f}")
    print(f"{'batch':>5} {'output':>6} {'logprobs':>8} {'us/step':>9} {'us/request':>10}")
    rows = []
    for batch in map(int, args.batches.split(",")):
        for length in map(int, args.lengths.split(",")):
            for lp in args.logprobs.split(","):
                logprobs = None if lp == "none" else int(lp)
                us = min(time_steps(batch, length, logprobs, args.steps) for _ in range(3))
                rows.append(dict(batch=batch, output_tokens=length, logprobs=logprobs, us_per_step=us))
                print(f"{batch:5d} {length:6d} {lp:>8} {us:9.0f} {us / batch:10.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(commit=commit, packing=packing, sampling=sampling, outputs=rows), f, indent=1)


if __name__ == "__main__":
    main()
