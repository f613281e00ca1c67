"""What holding step N+1 back for arrivals costs a steady decode (docs/BENCHMARKS.md, "Arrivals join
the held step").

An LLMEngine stepped through the overlap wrapper in this process with no request arriving: each round
runs B streams of T tokens with the window (the wrapper holding steps back for arrivals, as
AsyncLLMEngine's does) and then without it (None), and prints the time per step of each, and how many
windows closed only after the step in flight had ended (then the device waited for the dispatch).

    python scripts/bench_arrival_window.py --config configs/smollm2-135m-dummy.yaml --streams 4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import yaml

from jaxserve.config import EngineConfig
from jaxserve.engine.overlap import Overlap
from jaxserve.llm_engine import LLMEngine
from jaxserve.sampling.params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2-135m-dummy.yaml")
    ap.add_argument("--model", help="the model directory, if not the config's")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    with open(args.config) as f:
        settings = yaml.safe_load(f)
    if args.model:
        settings["model"] = args.model
    engine = LLMEngine(EngineConfig(**settings))
    overlap = Overlap(engine)
    hold = overlap._wait_for_arrivals  # what the server's engine waits with
    late = []  # per window: whether the step in flight had ended when it closed

    def counting_hold(pending, until):
        added = hold(pending, until)
        late.append(pending.is_ready())
        return added

    results = {"window": [], "none": []}
    for rnd in range(args.rounds):
        for label in results:
            overlap.arrivals = label == "window"
            overlap._wait_for_arrivals = counting_hold
            late.clear()
            params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
            for i in range(args.streams):
                engine.add_request(
                    f"{label}-{rnd}-{i}", None, params, [10 + (i + j) % 500 for j in range(args.prompt_len)]
                )
            for _ in range(8):  # past the prompts: a steady decode from here
                overlap.step()
            steps, start = engine.counters["steps"], time.perf_counter()
            while overlap.has_unfinished_requests():
                overlap.step()
            n = engine.counters["steps"] - steps
            ms = 1e3 * (time.perf_counter() - start) / n
            results[label].append({"ms_per_step": ms, "steps": n, "windows": len(late), "closed_late": sum(late)})
            print(
                f"round {rnd} {label:6s}: {ms:6.2f} ms/step over {n} steps"
                + (
                    f"; {sum(late)} of {len(late)} windows closed after the step in flight ended"
                    if label == "window"
                    else ""
                ),
                flush=True,
            )
    med = {k: statistics.median(r["ms_per_step"] for r in v) for k, v in results.items()}
    print(
        f"median ms/step: window {med['window']:.2f}, none {med['none']:.2f} "
        f"({100 * (med['window'] / med['none'] - 1):+.1f}%)  [{platform.processor() or platform.machine()}]"
    )
    overlap.close()
    engine.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results, "median_ms_per_step": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
