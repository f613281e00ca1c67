#!/usr/bin/env python
"""Resident memory of one process while a model loads: growth of its peak (VmHWM) over its resident set
before the load, against the bytes of the weights it serves.

    python scripts/measure_load_memory.py                     # the default model, float32
    python scripts/measure_load_memory.py --quantization int8 --model path/to/model.gguf

One model per process (the peak is the process's own); the engine is built without warm-up and with
a tiny KV cache, so what grows is the load.
"""

from __future__ import annotations

import argparse
import time


def status_mib(field: str) -> float:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="what LLM(...) takes (default: the default model)")
    ap.add_argument("--quantization", default="none")
    args = ap.parse_args()
    import jax

    jax.numpy.zeros(1).block_until_ready()  # the runtime's own memory counts as before
    from jaxserve.loading.model_source import resolve_model_path

    resolve_model_path(args.model)  # a GGUF file's metadata read once, outside the measured load
    before = status_mib("VmRSS:")
    from jaxserve import LLM
    from jaxserve.model.weights import param_bytes

    start = time.perf_counter()
    llm = LLM(args.model, quantization=args.quantization, warm_up=False, max_model_len=256, max_num_seqs=1, num_pages=4)
    seconds = time.perf_counter() - start
    served = param_bytes(llm.runner.params) / 2**20
    peak = status_mib("VmHWM:")
    print(
        f"quantization={args.quantization}: served params {served:.0f} MiB; RSS before {before:.0f} MiB, "
        f"peak {peak:.0f} MiB (+{peak - before:.0f} MiB = {(peak - before) / served:.2f}x the served bytes), "
        f"after {status_mib('VmRSS:'):.0f} MiB; load {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
