"""One process of a multi-host test job: N local processes x 2 virtual CPU devices, gloo over loopback.

    python tests/multihost_driver.py --model DIR --port P --process-id I [--num-processes 2] [--mesh 1,4]
                                     [--out FILE] [--forever READY_FILE] [--speculate ngram|draft]

Process 0 runs `workload()` through `LLM.generate` and writes the token ids as JSON to --out; the
others run the follower loop and exit 0 when process 0 shuts down. --forever: process 0 runs a one-prompt
workload, creates READY_FILE and repeats the workload until killed (the kill test). --speculate: speculative
decoding (SPECULATION; the draft method drafts with the model itself). tests/test_multihost.py launches it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Few buckets (5 shapes), all compiled at start-up as a server does (compile time dominates these jobs).
SETTINGS = dict(
    dtype="float32",
    page_size=8,
    max_model_len=64,
    max_num_seqs=2,
    max_num_batched_tokens=16,
    warm_up=True,
    compilation_cache_dir="none",
)
# Not adaptive: every row with a proposal speculates, whatever the (machine-dependent) step times. Two
# tokens: verify widths 1 and 2 only (every executable is compiled on both processes of a 2-core box).
SPECULATION = dict(num_speculative_tokens=2, speculative_adaptive=False)


def speculation(method: str | None, model: str) -> dict:
    if method is None:
        return {}
    draft = dict(speculative_model=model) if method == "draft" else {}
    return dict(SPECULATION, speculative_method=method, **draft)


def workload(small: bool = False):
    """(prompt ids, SamplingParams) pairs: greedy rows, a seeded n=2 request (page copies of the fork)
    and a penalised one (the token history travels in the step message). small: one greedy prompt."""
    import numpy as np

    from jaxserve import SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [np.random.RandomState(i).randint(0, 512, size=5 + 7 * i).tolist() for i in range(5)]
    requests = [(p, greedy) for p in prompts]
    if small:
        return requests[:1]
    requests.append((prompts[1], SamplingParams(max_tokens=8, temperature=0.8, seed=7, n=2, ignore_eos=True)))
    requests.append((prompts[2], SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, ignore_eos=True)))
    return requests


def run(llm, small: bool = False) -> list[list[list[int]]]:
    prompts, params = zip(*workload(small))
    outputs = llm.generate(prompt_token_ids=list(prompts), sampling_params=list(params), use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--mesh", default="1,4")
    parser.add_argument("--devices-per-process", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--forever", default=None, metavar="READY_FILE")
    parser.add_argument("--speculate", default=None, choices=["ngram", "draft"])
    args = parser.parse_args()
    start = time.perf_counter()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices_per_process}"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    from jaxserve import LLM
    from jaxserve.runner import multihost

    llm = LLM(
        args.model,
        mesh_shape=tuple(int(x) for x in args.mesh.split(",")),
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        distributed_timeout=10,
        **SETTINGS,
        **speculation(args.speculate, args.model),
    )
    ready = time.perf_counter()
    if args.process_id != 0:
        return multihost.run_follower(llm.engine)
    tokens = run(llm, small=args.forever is not None)
    print(
        f"driver: engine ready in {ready - start:.1f} s, workload in {time.perf_counter() - ready:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(tokens=tokens, stats=llm.engine.stats()), f)
    if args.forever:
        open(args.forever, "w").close()
        while True:
            run(llm, small=True)
    llm.engine.multihost.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
