#!/usr/bin/env python
"""Quantization benchmark: bytes and batch-1 decode speed of int8 weights / int8 KV cache vs float32 and bfloat16.

Builds the (dummy-weight) model once per variant through the public API and times batch-1 decode
with scripts/bench_decode.py's functions: LLM.generate ((N-token time - 1-token time) / (N - 1))
and the compiled step alone, synced every step. Variants are timed round-robin, one repeat each per
round, so a shared machine's load falls on all of them alike. Also reports, from the memory plan's
arithmetic, parameter bytes, KV bytes per token, and how many sequences of --context tokens fit in
a --kv-budget of KV memory.

Variants (--variants, comma-separated):
  float32, bfloat16            float weights and activations
  int8, int8-bf16              int8 weights (f32 scales), float32 / bfloat16 activations
  int4                         int4 weights (dense linear layers, groups of 32 input rows)
  int8-head, int4-head         also the lm_head (the default model's: the tied embedding table)
  int8-whole                   int8 weights, each widened whole before its matmul
                               (quantized_matmul_backend=reference) instead of the CPU default's
                               cache-sized chunks
  int8-kv8                     int8 weights and an int8 KV cache, float32 activations
  w8a8                         int8 weights (a scale per output channel) times int8 activations per token
  NAME@gN                      any quantized variant with quantization_group_size=N (int8: 0 = a
                               scale per output channel), e.g. int8@g32, int8-head@g0, int4@g64
  kv8                          float32 weights, int8 KV cache
  kv-fp8, kv-fp8-e5m2          float32 weights, float8 KV cache (vLLM's fp8 = e4m3, and e5m2): what
                               XLA:CPU's float8 conversions cost a step
  bfloat16-xla-default, int8-xla-default   the same steps compiled with XLA's default CPU scheduler
                               (the engine uses the memory-optimized one; see engine.compile)

The machine is shared and noisy: compare ratios within one run.

--default-model: the real default model (SmolLM2-135M-Instruct's Q4_1 GGUF, `LLM()` with no model),
not dummy weights; decode tok/s of float32, int8 and int4 (--variants) at each of --batches, all
variants and batches built first and timed round-robin (generate of B prompts: (N-token time -
1-token time) / (N - 1) per step, B tokens a step).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 nice -n 5 \\
        python scripts/bench_quant.py --out bench_quant.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode  # noqa: E402  (this directory: shared timing code)

VARIANTS = {
    "float32": ("float32", {}, None),
    "bfloat16": ("bfloat16", {}, None),
    "int8": ("float32", {"quantization": "int8"}, None),
    "int4": ("float32", {"quantization": "int4"}, None),
    "int8-head": ("float32", {"quantization": "int8", "quantize_lm_head": True}, None),
    "int4-head": ("float32", {"quantization": "int4", "quantize_lm_head": True}, None),
    "int8-bf16": ("bfloat16", {"quantization": "int8"}, None),
    "int8-whole": ("float32", {"quantization": "int8", "quantized_matmul_backend": "reference"}, None),
    "int8-kv8": ("float32", {"quantization": "int8", "kv_cache_dtype": "int8"}, None),
    "w8a8": ("float32", {"quantization": "int8", "activation_quantization": "int8"}, None),
    "kv8": ("float32", {"kv_cache_dtype": "int8"}, None),
    "kv-fp8": ("float32", {"kv_cache_dtype": "fp8"}, None),
    "kv-fp8-e5m2": ("float32", {"kv_cache_dtype": "fp8_e5m2"}, None),
    "bfloat16-xla-default": ("bfloat16", {}, {}),
    "int8-xla-default": ("float32", {"quantization": "int8"}, {}),
}
DEFAULT_VARIANTS = "float32,bfloat16,int8,int8-whole,int8-kv8,kv8"


def build(args, dtype: str, settings: dict, compiler_options: dict | None, prompt: list[int]):
    """An LLM for one variant, its steps compiled by an untimed generate (as bench_decode does)."""
    import logging

    from jaxserve import LLM

    llm = LLM(
        model=args.model,
        load_format="dummy",
        dtype=dtype,
        seed=args.seed,
        max_num_seqs=1,
        max_num_batched_tokens=len(prompt),
        max_model_len=len(prompt) + args.new_tokens,
        warm_up=False,
        **settings,
    )
    logging.getLogger("jaxserve.runner.runner").setLevel(logging.ERROR)  # "compiling unplanned shape"
    if compiler_options is not None:
        llm.runner.compiler_options = compiler_options
    return llm


def generate_fn(llm, prompt: list[int], n: int):
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def run():
        return llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids

    return run


def capacity(cfg, dtype: str, kv_cache_dtype: str, budget: int, context: int, page_size: int) -> dict:
    """Sequences of `context` tokens that fit in `budget` bytes of KV cache (the engine's page arithmetic)."""
    import jax.numpy as jnp

    from jaxserve.config import EngineConfig
    from jaxserve.planning.memory import plan_memory

    plan = plan_memory(
        cfg,
        EngineConfig(page_size=page_size, kv_cache_memory=budget, max_model_len=context, kv_cache_dtype=kv_cache_dtype),
        jnp.dtype(dtype),
    )
    return {
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "pages": plan.num_pages,
        "tokens": plan.tokens_that_fit,
        "max_sequences": (plan.num_pages - 1) // math.ceil(context / page_size),
    }


def variant(name: str) -> tuple[str, dict, dict | None]:
    """(dtype, engine settings, compiler options) of a variant name, `@gN` setting the group size."""
    base, _, group = name.partition("@g")
    dtype, settings, options = VARIANTS[base]
    return dtype, {**settings, "quantization_group_size": int(group)} if group else settings, options


def bench_default_model(args, variants: list[str]) -> dict:
    """Decode tok/s of the default model per (variant, batch), timed round-robin."""
    import logging

    from jaxserve import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    llms, results = {}, {}
    for name in variants:
        dtype, settings, _ = variant(name)
        for b in batches:
            t_build, llm = bench_decode.timed(
                lambda: LLM(
                    dtype=dtype,
                    seed=args.seed,
                    max_num_seqs=b,
                    max_num_batched_tokens=max(64, b * args.prompt_len),
                    max_model_len=args.prompt_len + args.new_tokens + 8,
                    warm_up=False,
                    **settings,
                )
            )
            logging.getLogger("jaxserve.runner.runner").setLevel(logging.ERROR)
            rng = np.random.default_rng(args.seed + b)  # every variant decodes the same prompts
            prompts = [rng.integers(1, llm.model_config.vocab_size, args.prompt_len).tolist() for _ in range(b)]
            llms[name, b] = (llm, prompts)
            run = _batch_generate(llm, prompts, args.new_tokens)
            t_first, tokens = bench_decode.timed(lambda: (_batch_generate(llm, prompts, 1)(), run())[1])
            results[name, b] = {
                "param_bytes": llm.memory.param_bytes,
                "plan": llm.memory.describe(),
                "build_s": t_build,
                "first_generate_s": t_first,
                "tokens": tokens,
                "t1": [],
                "tn": [],
            }
            print(f"built {name} batch {b} in {t_build:.0f} s; {llm.memory.describe()}", flush=True)
    for r in range(args.repeats):
        for (name, b), (llm, prompts) in llms.items():
            res = results[name, b]
            res["t1"].append(bench_decode.timed(_batch_generate(llm, prompts, 1))[0])
            res["tn"].append(bench_decode.timed(_batch_generate(llm, prompts, args.new_tokens))[0])
        print(f"round {r + 1}/{args.repeats} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    out = {}
    print(
        f"\n{'variant':8} {'batch':>5} {'param MB':>9} {'step ms':>8} {'tok/s':>8} {'vs f32':>7} {'greedy = f32':>13}"
    )
    for (name, b), res in results.items():
        summary = bench_decode.summarize(res.pop("t1"), res.pop("tn"), args.new_tokens)
        step = summary["decode_ms_per_token"]
        res.update(summary, tok_s=b * 1e3 / step)
        out[f"{name}@{b}"] = res
    for (name, b), res in results.items():
        base = results.get(("float32", b))
        ratio = res["tok_s"] / base["tok_s"] if base else float("nan")
        agree = (
            sum(x == y for t, u in zip(res["tokens"], base["tokens"]) for x, y in zip(t, u))
            / sum(len(t) for t in base["tokens"])
            if base
            else float("nan")
        )
        res["vs_float32"], res["greedy_agreement"] = ratio, agree
        print(
            f"{name:8} {b:5d} {res['param_bytes'] / 1e6:9.1f} {res['decode_ms_per_token']:8.2f} "
            f"{res['tok_s']:8.1f} {ratio:6.2f}x {agree:13.3f}"
        )
    return out


def _batch_generate(llm, prompts: list[list[int]], n: int):
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def run():
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.normpath(bench_decode.DEFAULT_MODEL))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-iters", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-budget", type=int, default=2**30, help="KV-cache bytes for the capacity figures")
    ap.add_argument("--context", type=int, default=2048, help="sequence length for the capacity figures")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--default-model", action="store_true", help="the real default model (see above)")
    ap.add_argument("--batches", default="1,16", help="with --default-model: decode batch sizes")
    ap.add_argument("--out")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v.partition("@g")[0] not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if not bench_decode.tcmalloc_loaded():
        print(
            f"hint: run with LD_PRELOAD={bench_decode.tcmalloc_path() or 'libtcmalloc_minimal.so.4'}", file=sys.stderr
        )

    if args.default_model:
        report = {"args": vars(args), "machine": bench_decode.machine_info()}
        m = report["machine"]
        print(f"{m['cpu']}, {m['cores']} cores; jax {m['jax']}; load average {os.getloadavg()[0]:.1f}", flush=True)
        report["results"] = bench_default_model(args, variants)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
        return

    from jaxserve.config import ModelConfig
    from jaxserve.model.weights import param_bytes

    cfg = ModelConfig.from_dir(args.model)
    prompt = np.random.default_rng(args.seed).integers(1, cfg.vocab_size, args.prompt_len).tolist()
    report = {"args": vars(args), "machine": bench_decode.machine_info()}
    m = report["machine"]
    print(
        f"{m['cpu']}, {m['cores']} cores; jax {m['jax']}; tcmalloc preloaded: {m['tcmalloc_preloaded']}; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    report["machine"]["load_average_start"] = os.getloadavg()

    report["capacity"] = {
        f"{dtype} KV" if kv == "auto" else "int8 KV": capacity(
            cfg, dtype, kv, args.kv_budget, args.context, args.page_size
        )
        for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8"))
    }
    report["param_bytes"] = {
        f"{dtype}{' + int8 weights' if q == 'int8' else ''}": cfg.param_bytes(b, q)
        for dtype, b, q in (
            ("float32", 4, "none"),
            ("bfloat16", 2, "none"),
            ("float32", 4, "int8"),
            ("bfloat16", 2, "int8"),
        )
    }
    # All variants are built first, then timed round-robin (one repeat of each per round), so that
    # the load of a shared machine falls on all of them alike.
    llms, results = {}, {}
    for name in variants:
        dtype, settings, options = variant(name)
        print(
            f"== building {name}: dtype {dtype}, settings {settings}"
            f"{', XLA default CPU scheduler' if options == {} else ''}",
            flush=True,
        )
        t_build, llm = bench_decode.timed(lambda: build(args, dtype, settings, options, prompt))
        t_compile, tokens = bench_decode.timed(
            lambda: (generate_fn(llm, prompt, 1)(), generate_fn(llm, prompt, args.new_tokens)())[1]
        )
        llms[name] = llm
        results[name] = {
            "dtype": dtype,
            "settings": settings,
            "xla_default_scheduler": options == {},
            "plan": llm.memory.describe(),
            "param_bytes": param_bytes(llm.runner.params),
            "kv_bytes_per_token": llm.memory.kv_bytes_per_token,
            "build_s": t_build,
            "first_generate_s": t_compile,
            "tokens": tokens,
            "t1": [],
            "tn": [],
            "step": [],
        }
        print(f"  {results[name]['plan']}", flush=True)
    one = argparse.Namespace(**{**vars(args), "repeats": 1})
    for r in range(args.repeats):
        for name, llm in llms.items():
            res = results[name]
            res["t1"].append(bench_decode.timed(generate_fn(llm, prompt, 1))[0])
            res["tn"].append(bench_decode.timed(generate_fn(llm, prompt, args.new_tokens))[0])
            steps = bench_decode.bench_steps(one, llm, res["tokens"][0], len(prompt), len(prompt) + args.new_tokens)
            res["step"].append(steps["compiled_step"]["raw_s"][0])
        print(f"round {r + 1}/{args.repeats} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    for name, res in results.items():
        res["llm_generate"] = bench_decode.summarize(res.pop("t1"), res.pop("tn"), args.new_tokens)
        raw = res.pop("step")
        res["compiled_step"] = {"decode_ms_per_token": statistics.median(raw) * 1e3, "raw_s": raw}
    report["results"] = results
    report["machine"]["load_average_end"] = os.getloadavg()

    base = report["results"].get("float32", {}).get("tokens")
    print(
        f"\n{'variant':22} {'param MB':>9} {'generate ms':>12} {'tok/s':>7} {'step ms':>8} {'tok/s':>7}"
        f" {'vs bf16':>8} {'greedy = f32':>13}"
    )
    bf16 = report["results"].get("bfloat16", {}).get("compiled_step", {}).get("decode_ms_per_token")
    for name, r in report["results"].items():
        gen = r["llm_generate"]["decode_ms_per_token"]
        step = r.get("compiled_step", {}).get("decode_ms_per_token", float("nan"))
        agree = bench_decode.agreement(r["tokens"], base) if base else None
        print(
            f"{name:22} {r['param_bytes'] / 1e6:9.1f} {gen:12.2f} {1e3 / gen:7.1f} {step:8.2f} {1e3 / step:7.1f}"
            f" {bf16 / step if bf16 else float('nan'):7.2f}x {agree if agree is not None else '-':>13}"
        )
    print(f"\nKV capacity at {args.context} tokens in {args.kv_budget / 2**30:.2f} GiB:")
    for name, c in report["capacity"].items():
        print(
            f"  {name:14} {c['kv_bytes_per_token']:6d} bytes/token  {c['tokens']:8d} tokens  "
            f"{c['max_sequences']:4d} sequences"
        )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
