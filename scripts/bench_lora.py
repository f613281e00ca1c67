#!/usr/bin/env python
"""Decode throughput of the default model serving LoRA adapters against the base model alone (issue 41).

Builds PEFT-format adapters for the model itself (adapter_config.json + adapter_model.safetensors,
PEFT's tensor names, random A and B drawn with numpy: no torch or peft needed) in a temporary
directory, then times steady decode of the same random prompts (greedy, EOS ignored, --tokens new
tokens) at each of --batch-sizes for:

  base         the model with LoRA disabled
  lora-off     enable_lora, max_loras / max_lora_rank as below, every request on the base model:
               what the enabled path costs by itself (every step still reads the resident stacks)
  N adapters   the same engine, the batch's requests spread evenly over --adapters adapters
               (request i uses adapter i % N), all resident (max_loras = --max-loras, default N)
  1 adapter    the same engine, every request on one adapter (--no-single skips it)

As scripts/bench_quant.py --default-model does: every engine is built and warmed up first, then the
variants are timed round-robin, --repeats rounds, each a 1-token and a --tokens-token generate of
the batch; step time = (N-token time - 1-token time) / (N - 1) (prefill cancels), medians over
rounds; "vs base" is the median over rounds of base's step time over the variant's in the same
round, so that a slow stretch of a shared machine falls on both. "= base" is the share of the
generated tokens equal to the base model's (1.000 for lora-off; adapters of random weights move
them, showing they are applied).

Also prints the bytes a decode step reads: the base weights (ModelConfig.param_bytes, less an
untied embedding table, which a step only gathers rows of) against the resident adapter stacks
(runner.lora.nbytes = layers x max_loras x max_lora_rank x sum(in + out) x itemsize, the sum over
every adaptable module: the engine stacks all seven whatever --modules the adapters target), and the
same for --bytes-model (default configs/models/llama3-8b, bfloat16) at a few (max_loras, rank).

    python scripts/bench_lora.py --json /tmp/bench_lora.json
    python scripts/bench_lora.py --batch-sizes 16 --adapters 4 --rank 16 --modules q,v --repeats 5

docs/BENCHMARKS.md ("LoRA adapters: decode throughput (issue 41)") and docs/TUNING.md ("LoRA
adapters") quote it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxserve.lora.request import PEFT_NAMES  # jaxserve's module key -> PEFT / transformers module name

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BYTES_POINTS = ((4, 16), (8, 16), (4, 64), (8, 64))  # (max_loras, max_lora_rank) of the bytes table
H100_BANDWIDTH = 3.35e12  # bytes/s, H100 SXM HBM3


# ---- adapters ------------------------------------------------------------------------------------
def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """A float32 safetensors file (the format: u64 header length, JSON header, raw little-endian data)."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)


def write_peft_adapter(
    out_dir: str,
    cfg,
    *,
    rank: int,
    modules: tuple[str, ...],
    seed: int = 0,
    std: float = 0.02,
    lora_alpha: float | None = None,
) -> str:
    """A PEFT LoRA directory for the model `cfg` (jaxserve ModelConfig): every layer's `modules`
    (jaxserve keys: q k v o gate up down) with lora_A [r, in] and lora_B [out, r] drawn from N(0, std)
    (PEFT would start B at zero: an adapter that changes nothing), lora_alpha = r by default (scaling 1)."""
    from jaxserve.lora.peft_adapter import lora_module_dims

    dims = lora_module_dims(cfg)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m in modules:
            block, proj = "self_attn" if m in ("q", "k", "v", "o") else "mlp", PEFT_NAMES[m]
            d_in, d_out = dims[m]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) * std).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((d_out, rank)) * std).astype(np.float32)
    os.makedirs(out_dir, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": float(rank if lora_alpha is None else lora_alpha),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "target_modules": [PEFT_NAMES[m] for m in modules],
        "base_model_name_or_path": None,
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    write_safetensors(os.path.join(out_dir, "adapter_model.safetensors"), tensors)
    return out_dir


# ---- bytes ---------------------------------------------------------------------------------------
def step_weight_bytes(cfg, itemsize: int) -> int:
    """Base weight bytes a decode step reads: all of them, less an untied embedding table (a step
    gathers only its rows; a tied one is read whole as the head)."""
    table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * itemsize
    return cfg.param_bytes(itemsize) - table


def bytes_rows(cfg, itemsize: int, points=BYTES_POINTS, bandwidth: float = H100_BANDWIDTH) -> list[dict]:
    """Per (max_loras, max_lora_rank): the resident stacks' bytes against the base weights a step reads,
    and the milliseconds each takes at `bandwidth` (decode is memory-bound: time ~ bytes / bandwidth)."""
    from jaxserve.lora.peft_adapter import lora_stack_bytes as lora_bytes

    base = step_weight_bytes(cfg, itemsize)
    rows = []
    for slots, rank in points:
        extra = lora_bytes(cfg, slots, rank, itemsize)
        rows.append(
            {
                "max_loras": slots,
                "max_lora_rank": rank,
                "lora_bytes": extra,
                "base_bytes": base,
                "fraction": extra / base,
                "base_ms": base / bandwidth * 1e3,
                "extra_ms": extra / bandwidth * 1e3,
            }
        )
    return rows


# ---- timing --------------------------------------------------------------------------------------
def batch_generate(llm, prompts: list[list[int]], n: int, loras):
    """A function generating n tokens for every prompt (greedy, EOS ignored) under `loras` (None or one
    LoRARequest-or-None per prompt), returning the token ids."""
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def run():
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, lora_request=loras)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def variants(requests: list, single: bool) -> list[tuple[str, bool, object]]:
    """(name, LoRA engine?, adapter of request i: f(i) -> LoRARequest | None)."""
    out = [
        ("base", False, lambda i: None),
        ("lora-off", True, lambda i: None),
        (f"{len(requests)} adapters", True, lambda i: requests[i % len(requests)]),
    ]
    if single and len(requests) > 1:
        out.append(("1 adapter", True, lambda i: requests[0]))
    return out


def machine() -> dict:
    def run(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    import jax

    lscpu = run("lscpu").splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu if line.startswith("Model name")), "unknown")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": run("git", "rev-parse", "--short", "HEAD"),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "load_average_start": os.getloadavg(),
    }


def agreement(tokens: list[list[int]], base: list[list[int]]) -> float:
    return sum(x == y for t, u in zip(tokens, base) for x, y in zip(t, u)) / max(1, sum(len(u) for u in base))


def run_bench(args) -> dict:
    from jaxserve import LLM, LoRARequest

    report = {"args": vars(args), "machine": machine()}
    m = report["machine"]
    print(
        f"{m['cpu']}, {m['cores']} cores; jax {m['jax']} ({m['backend']}); commit {m['commit']}; {m['date']}; "
        f"load average {m['load_average_start'][0]:.1f}",
        flush=True,
    )
    modules = tuple(x.strip() for x in args.modules.split(",") if x.strip())
    batches = [int(b) for b in args.batch_sizes.split(",")]
    max_loras = args.max_loras or args.adapters
    engines, runs = [], {}  # (variant, batch) -> {"llm", "prompts", "loras", ...}
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as work:
        cfg = None
        for b in batches:
            common = dict(
                dtype=args.dtype,
                seed=args.seed,
                max_num_seqs=b,
                max_model_len=args.prompt_len + args.tokens + 8,
                max_num_batched_tokens=max(64, b * args.prompt_len),
                warm_up=False,
            )
            t_base, base_llm = timed(lambda: LLM(args.model, **common))
            t_lora, lora_llm = timed(
                lambda: LLM(args.model, enable_lora=True, max_loras=max_loras, max_lora_rank=args.rank, **common)
            )
            engines += [base_llm, lora_llm]
            logging.getLogger("jaxserve.runner.runner").setLevel(logging.ERROR)  # "compiling unplanned shape"
            if cfg is None:
                cfg = base_llm.model_config
                paths = [
                    write_peft_adapter(
                        os.path.join(work, f"adapter{i}"),
                        cfg,
                        rank=args.rank,
                        modules=modules,
                        seed=args.seed + i,
                        std=args.std,
                    )
                    for i in range(args.adapters)
                ]
                requests = [LoRARequest(f"bench{i}", i + 1, p) for i, p in enumerate(paths)]
            rng = np.random.default_rng(args.seed + b)  # every variant decodes the same prompts
            prompts = [rng.integers(1, cfg.vocab_size, args.prompt_len).tolist() for _ in range(b)]
            for name, uses_lora, adapter in variants(requests, args.single):
                llm = lora_llm if uses_lora else base_llm
                loras = [adapter(i) for i in range(b)] if uses_lora else None
                run = batch_generate(llm, prompts, args.tokens, loras)
                t_first, tokens = timed(lambda: (batch_generate(llm, prompts, 1, loras)(), run())[1])  # compiles
                runs[name, b] = {
                    "llm": llm,
                    "prompts": prompts,
                    "loras": loras,
                    "tokens": tokens,
                    "t1": [],
                    "tn": [],
                    "first_generate_s": t_first,
                }
            slots = lora_llm.runner.lora
            print(
                f"built batch {b}: base {t_base:.0f} s, LoRA {t_lora:.0f} s ({slots.slots} slots of rank {slots.rank}, "
                f"{slots.nbytes / 1e6:.1f} MB); {base_llm.memory.describe()}",
                flush=True,
            )
        loads = []
        for r in range(args.repeats):
            for (name, b), res in runs.items():
                res["t1"].append(timed(batch_generate(res["llm"], res["prompts"], 1, res["loras"]))[0])
                res["tn"].append(timed(batch_generate(res["llm"], res["prompts"], args.tokens, res["loras"]))[0])
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.repeats} done; load average {loads[-1]:.1f}", flush=True)
        report["machine"]["load_average_rounds"] = loads
        report["machine"]["load_average_end"] = os.getloadavg()
        itemsize = np.dtype(args.dtype).itemsize
        lora_nbytes = engines[1].runner.lora.nbytes
        report["bytes"] = {
            "dtype": args.dtype,
            "base_weights": step_weight_bytes(cfg, itemsize),
            "param_bytes": cfg.param_bytes(itemsize),
            "lora_stacks": lora_nbytes,
            "max_loras": max_loras,
            "max_lora_rank": args.rank,
            "modules": list(modules),
            "stacked_modules": list(engines[1].runner.lora.dims),
        }  # every adaptable module, targeted or not
        report["bytes"]["fraction"] = lora_nbytes / report["bytes"]["base_weights"]
        for llm in engines:
            llm.close()
    report["results"] = summarize(runs, args.tokens)
    if args.bytes_model:
        from jaxserve.config import ModelConfig

        other = ModelConfig.from_dir(args.bytes_model)
        report["bytes_model"] = {
            "model": os.path.relpath(args.bytes_model, ROOT),
            "dtype": args.bytes_dtype,
            "rows": bytes_rows(other, np.dtype(args.bytes_dtype).itemsize),
        }
    report["default_model_bytes"] = [
        {"model": "the benchmarked model", "dtype": dtype, "rows": bytes_rows(cfg, np.dtype(dtype).itemsize)}
        for dtype in dict.fromkeys((args.dtype, "bfloat16"))
    ]
    return report


def summarize(runs: dict, n: int) -> list[dict]:
    """One row per (variant, batch): median step time, tokens/s, the per-round ratio to base, agreement."""
    rows = []
    for (name, b), res in runs.items():
        steps = [(tn - t1) / (n - 1) for t1, tn in zip(res["t1"], res["tn"])]
        base = runs["base", b]
        base_steps = [(tn - t1) / (n - 1) for t1, tn in zip(base["t1"], base["tn"])]
        step = statistics.median(steps)
        rows.append(
            {
                "variant": name,
                "batch": b,
                "step_ms": step * 1e3,
                "tokens_per_s": b / step,
                "vs_base": statistics.median(bs / s for bs, s in zip(base_steps, steps)),
                "vs_base_of_medians": statistics.median(base_steps) / step,
                "equal_to_base": agreement(res["tokens"], base["tokens"]),
                "step_ms_rounds": [s * 1e3 for s in steps],
                "first_generate_s": res["first_generate_s"],
            }
        )
    return rows


def markdown(report: dict) -> str:
    a, m, by = report["args"], report["machine"], report["bytes"]
    lines = [
        f"{m['cpu']}, {m['cores']} cores, {m['date']}, commit {m['commit']}, jax {m['jax']}; load average "
        f"{m['load_average_start'][0]:.1f} at start, {min(m['load_average_rounds']):.1f} to "
        f"{max(m['load_average_rounds']):.1f} over the rounds",
        f"{a['dtype']}, rank {a['rank']}, modules {a['modules']}, max_loras {by['max_loras']}, "
        f"prompt {a['prompt_len']} tokens, {a['tokens']} new, {a['repeats']} rounds",
        "",
        "| batch | variant | step ms | tok/s | vs base | = base |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['batch']} | {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.1f} | "
            f"{r['vs_base']:.2f}x | {r['equal_to_base']:.3f} |"
        )
    lines += [
        "",
        f"bytes a decode step reads ({by['dtype']}): base weights {by['base_weights'] / 1e6:.1f} MB, "
        f"resident adapters {by['lora_stacks'] / 1e6:.1f} MB ({by['max_loras']} x rank {by['max_lora_rank']}, "
        f"stacks for {len(by['stacked_modules'])} modules whatever the adapters target): {by['fraction']:.1%} "
        f"of the base; a step bound by bytes alone would "
        f"run at {1 / (1 + by['fraction']):.2f}x",
    ]
    for t in report["default_model_bytes"] + ([report["bytes_model"]] if "bytes_model" in report else []):
        lines += [
            "",
            f"{t['model']} ({t['dtype']}), all seven modules adapted:",
            "| max_loras | max_lora_rank | adapters MB | base MB | of base | H100 ms base | + adapters |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in t["rows"]:
            lines.append(
                f"| {r['max_loras']} | {r['max_lora_rank']} | {r['lora_bytes'] / 1e6:.1f} | "
                f"{r['base_bytes'] / 1e6:.1f} | {r['fraction']:.1%} | {r['base_ms']:.3f} | "
                f"+{r['extra_ms']:.3f} |"
            )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model directory or GGUF file (default: the default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--adapters", type=int, default=4, help="adapters the batch is spread over")
    ap.add_argument("--rank", type=int, default=16, help="every adapter's rank, and max_lora_rank")
    ap.add_argument("--max-loras", type=int, default=None, help="device slots (default: --adapters)")
    ap.add_argument("--modules", default="q,k,v,o,gate,up,down", help="adapted modules (jaxserve keys)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds")
    ap.add_argument("--std", type=float, default=0.02, help="std of the random lora_A / lora_B values")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-single", dest="single", action="store_false", help="skip the one-adapter variant")
    ap.add_argument(
        "--bytes-model",
        default=os.path.join(ROOT, "configs", "models", "llama3-8b"),
        help="a model config for the bytes table ('' for none)",
    )
    ap.add_argument("--bytes-dtype", default="bfloat16")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    bad = [m for m in args.modules.split(",") if m.strip() and m.strip() not in PEFT_NAMES]
    if bad:
        ap.error(f"unknown modules {bad}; choose from {','.join(PEFT_NAMES)}")
    if args.tokens < 2 or args.adapters < 1 or args.repeats < 1:
        ap.error("--tokens must be at least 2, --adapters and --repeats at least 1")
    if args.max_loras is not None and args.max_loras < args.adapters:
        ap.error("--max-loras below --adapters would swap adapters every step; this benchmark keeps them resident")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = run_bench(args)
    print("\n" + markdown(report), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}")
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
