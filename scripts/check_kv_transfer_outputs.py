"""Greedy outputs of the default model with KV pages that leave the engine equal the plain engine's
(issue 56): the prefix cache's host tier (pages evicted to host memory and loaded back), and prefill
and decode on two engines (`JaxTransferConnector`, pages pulled over `jax.experimental.transfer`), each
in float32 and with an int8 KV cache.

    python scripts/check_kv_transfer_outputs.py [--model SmolLM2-135M-Instruct] [--kv-dtypes auto,int8]

The tests check the same on a tiny model (`tests/kv_transfer/`); this runs the served model, outside
CI (a few minutes: five engines per KV dtype). Prints one JSON line per check and exits 1 if any
output differs or no page moved.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np

from jaxserve import LLM, SamplingParams

PAGE = 16
ENGINE = dict(dtype="float32", page_size=PAGE, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256)
POOL = 40  # pages: two prefixes' worth, so the turns evict; the host tier holds all four


def workload(seed: int = 0) -> list[list[int]]:
    """Four 192-token shared prefixes, each asked twice with its own 24-token question, in turns (the
    second ask of a prefix comes after the other three: evicted from a small pool by then)."""
    rng = np.random.default_rng(seed)
    shared = [rng.integers(100, 20000, 192).tolist() for _ in range(4)]
    return [shared[i % 4] + rng.integers(100, 20000, 24).tolist() for i in range(8)]


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int, params=None) -> list[list[int]]:
    """One request at a time (so each prompt sees the pool the previous ones left)."""
    out = []
    for i, ids in enumerate(prompts):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        if params is not None:
            sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, kv_transfer_params=params[i])
        out.append(llm.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=False)[0].outputs[0].token_ids)
    return out


def kv_config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "JaxTransferConnector", "kv_role": role, "kv_connector_extra_config": extra})


def check_host_tier(model: str, kv_dtype: str, prompts, reference) -> dict:
    with LLM(model, kv_cache_dtype=kv_dtype, num_pages=POOL, kv_offloading_size=0.5, **ENGINE) as llm:
        outputs = generate(llm, prompts, 16)
        stats = llm.engine.stats()
    return dict(
        check="host tier",
        kv_cache_dtype=kv_dtype,
        same=outputs == reference,
        pages_to_host=stats["kv_offload_pages_to_host_total"],
        pages_to_device=stats["kv_offload_pages_to_device_total"],
        moved=stats["kv_offload_pages_to_device_total"] > 0,
    )


def check_disaggregated(model: str, kv_dtype: str, prompts, reference) -> dict:
    settings = dict(ENGINE, kv_cache_dtype=kv_dtype)
    with (
        LLM(model, kv_transfer_config=kv_config("kv_producer"), **settings) as prefill,
        LLM(model, kv_transfer_config=kv_config("kv_consumer"), **settings) as decode,
    ):
        lock, stop = threading.Lock(), threading.Event()

        def pump():  # the producer steps while its connector holds pages (AsyncLLMEngine's step thread does)
            while not stop.is_set():
                with lock:
                    busy = prefill.engine.has_kv_transfers()
                    if busy:
                        prefill.engine.step()
                time.sleep(0.001 if busy else 0.01)

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        try:
            with lock:
                params = [
                    prefill.generate(
                        prompt_token_ids=[ids],
                        sampling_params=SamplingParams(
                            max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True}
                        ),
                        use_tqdm=False,
                    )[0].kv_transfer_params
                    for ids in prompts
                ]
            outputs = generate(decode, prompts, 16, params)
            stats = decode.engine.stats()
        finally:
            stop.set()
            thread.join()
    loaded = stats.get("external_prefix_cache_hits", 0)
    return dict(
        check="prefill and decode apart",
        kv_cache_dtype=kv_dtype,
        same=outputs == reference,
        prompt_tokens_loaded=loaded,
        moved=loaded > 0,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--kv-dtypes", default="auto,int8")
    args = ap.parse_args()
    prompts = workload()
    ok = True
    for kv_dtype in args.kv_dtypes.split(","):
        with LLM(args.model, kv_cache_dtype=kv_dtype, num_pages=POOL, **ENGINE) as llm:  # the same, no tier
            reference = generate(llm, prompts, 16)
        for check in (check_host_tier, check_disaggregated):
            result = check(args.model, kv_dtype, prompts, reference)
            print(json.dumps(result), flush=True)
            ok &= result["same"] and result["moved"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
