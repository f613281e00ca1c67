#!/usr/bin/env python
"""Time a speculative engine's compiled step on padding-page rows: each (batch, drafts) case's token
bucket and median time, with no engine around it (no scheduling, no host work). With --before COMMIT
the EAGLE-3 proposals (`jaxserve/spec_decode/eagle3_draft.py`) of that commit are loaded beside this
tree's and both steps are compiled and timed alternately in one process (the executable store is
off: it cannot tell the two apart).

    # batch 1 with 0, 1, 2, 4 drafts and batch 16 plain, this tree's EAGLE-3 step against the one before a164a64
    python scripts/bench_spec_step.py --cases 1:0,1:1,1:2,1:4,16:0 --before a164a64~1
    # n-gram (the target's verify alone), the fine token ladder
    python scripts/bench_spec_step.py --method ngram --token-buckets fine --cases 1:0,1:1,1:2,1:3,1:4
    # what a step that drafts nothing costs a speculative engine: its step against a plain engine's (same bucket)
    python scripts/bench_spec_step.py --cases 1:0,16:0 --plain
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def old_module(commit: str):
    """eagle3_draft.py as of `commit`, imported under another name."""
    source = subprocess.run(
        ["git", "show", f"{commit}:jaxserve/spec_decode/eagle3_draft.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "eagle3_draft_before.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("eagle3_draft_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--method", default="eagle3", choices=("eagle3", "ngram"))
    ap.add_argument("--head", default="checkpoints/eagle3-smollm2-135m")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--cases", default="1:0,1:1,1:2,1:4,16:0", help="batch:drafts, comma-separated")
    ap.add_argument("--context", type=int, default=256, help="each row's position")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--token-buckets", default="powers-of-two")
    ap.add_argument("--before", default=None, help="a commit whose eagle3_draft.py is timed beside this tree's")
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument(
        "--plain",
        action="store_true",
        help="also time an engine without speculation on the cases that draft nothing (its ragged step, same bucket)",
    )
    args = ap.parse_args()

    import jax

    import jaxserve.spec_decode.step as step_module
    from jaxserve import LLM
    from jaxserve.model.kv_cache import PADDING_PAGE
    from jaxserve.runner.step_row import StepRow

    spec = dict(speculative_method=args.method, num_speculative_tokens=args.k)
    if args.method == "eagle3":
        spec["speculative_model"] = args.head
    settings = dict(
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=512,
        token_buckets=args.token_buckets,
        warm_up=False,
        executable_store=args.before is None,
        enable_prefix_caching=False,
    )
    llm = LLM(args.model, **settings, **spec)
    runner = llm.runner
    plain = None
    if args.plain:  # the same model and buckets, no speculation: its plain ragged step
        plain = LLM(args.model, **settings).runner
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]

    def rows(batch, drafts):
        pages = [PADDING_PAGE] * -(-(args.context + drafts + 1) // 16)
        return [
            StepRow([0] * (drafts + 1), args.context, pages, num_drafts=drafts, draft_tokens=[0]) for _ in range(batch)
        ]

    versions = {"this tree": step_module.eagle3_draft}
    if args.before:
        versions = {args.before: old_module(args.before), **versions}
    runs = {}
    for name, module in versions.items():
        step_module.eagle3_draft = module
        runner.table.clear()
        jax.clear_caches()
        for batch, drafts in cases:
            packed = runner.prepare_inputs(rows(batch, drafts))
            run = runner.probe(packed.shape, packed.inputs)
            jax.block_until_ready(run())
            runs[(name, batch, drafts, packed.shape[0])] = run
    if plain is not None:
        for batch, drafts in cases:
            if drafts == 0:
                pages = [PADDING_PAGE] * -(-(args.context + 1) // 16)
                packed = plain.prepare_inputs([StepRow([0], args.context, pages) for _ in range(batch)])
                run = plain.probe(packed.shape, packed.inputs)
                jax.block_until_ready(run())
                runs[("no speculation", batch, 0, packed.shape[0])] = run
    times = {key: [] for key in runs}
    for _ in range(args.calls):
        for key, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            times[key].append(time.perf_counter() - start)
    print("| version | batch | drafts | token bucket | median ms |\n|---|---:|---:|---:|---:|")
    for (name, batch, drafts, bucket), t in times.items():
        print(f"| {name} | {batch} | {drafts} | {bucket} | {np.median(t) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
