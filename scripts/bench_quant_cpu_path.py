#!/usr/bin/env python
"""The CPU decode path of quantized weights, knob by knob: decode step time of the default model with
the chunking constants of `jaxserve.model.quant` set per variant (they are read when a step is traced,
so each variant's engine is built and compiled with its own), timed round-robin in one process.

    python scripts/bench_quant_cpu_path.py f32 int8 int8:g0 int8:g64 int8:g0:cb64 int8:g0:head:hb4096 \
        int4 w8a8:g0 [--batch 16]

A variant is the weight format (f32, int8, int4, w8a8) and `:`-separated knobs: gN (group size), head
(quantize the tied head), cbN (CHUNK_BYTES, KiB), hbN (COLUMN_CHUNK_BYTES, KiB), mrN (CHUNK_MAX_ROWS),
nocol (no column chunks for a wide weight). Step time = (48-token generate − 1-token) / 47, median of
3; ratios against the first variant. docs/BENCHMARKS.md ("int8 in groups, Q8_0 and W8A8") quotes it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    from jaxserve import LLM, SamplingParams
    from jaxserve.model import quant

    defaults = {
        name: getattr(quant, name) for name in ("CHUNK_BYTES", "COLUMN_CHUNK_BYTES", "CHUNK_MAX_ROWS", "WIDE_RATIO")
    }
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 40000, 32).tolist() for _ in range(args.batch)]

    def generate(llm, n: int) -> float:
        start = time.perf_counter()
        llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        )
        return time.perf_counter() - start

    llms = {}
    for name in args.variants:
        kind, *knobs = name.split(":")
        settings = {} if kind == "f32" else {"quantization": "int4" if kind == "int4" else "int8"}
        if kind == "w8a8":
            settings["activation_quantization"] = "int8"
        for attr, value in defaults.items():
            setattr(quant, attr, value)
        for knob in knobs:
            if knob == "head":
                settings["quantize_lm_head"] = True
            elif knob == "nocol":
                quant.WIDE_RATIO = 10**9
            elif knob[:1] == "g":
                settings["quantization_group_size"] = int(knob[1:])
            else:
                attr = {"cb": "CHUNK_BYTES", "hb": "COLUMN_CHUNK_BYTES", "mr": "CHUNK_MAX_ROWS"}[knob[:2]]
                setattr(quant, attr, int(knob[2:]) * (1024 if knob[:2] in ("cb", "hb") else 1))
        llm = LLM(
            dtype="float32",
            max_num_seqs=args.batch,
            max_num_batched_tokens=max(64, 32 * args.batch),
            max_model_len=96,
            warm_up=False,
            **settings,
        )
        generate(llm, 1), generate(llm, args.new_tokens)  # compiled here, with this variant's constants
        llms[name] = llm
    steps: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(3):
        for name, llm in llms.items():
            one, many = generate(llm, 1), generate(llm, args.new_tokens)
            steps[name].append((many - one) / (args.new_tokens - 1) * 1e3)
    base = float(np.median(steps[args.variants[0]]))
    for name, times in steps.items():
        step = float(np.median(times))
        print(
            f"{name:28s} batch {args.batch}: step {step:6.2f} ms  {args.batch * 1e3 / step:7.1f} tok/s  "
            f"{base / step:5.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
