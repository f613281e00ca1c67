#!/usr/bin/env python
"""Batch-1 decode benchmark: jaxserve vs Hugging Face transformers on the same (dummy) weights.

For each dtype it builds the model through the public API (`LLM(model=DIR, load_format="dummy")`),
converts the very same params into a `LlamaForCausalLM` state dict, and times greedy generation of a
fixed random prompt with EOS ignored:

* TTFT        = median time of a generate call with 1 new token (prefill + first sample)
* decode      = (median time for N new tokens - median time for 1 new token) / (N - 1)
* jaxserve is also timed below the Python loop: `ModelRunner.execute` with a prepared row, and the
  compiled step executable called directly on device-resident inputs (synced each step, like decode
  must be). The differences are the host overhead of each layer.
* achieved weight bandwidth = param bytes / decode time, against a quick read-bandwidth measurement.

Warm-up runs are excluded; each timing is the median of --repeats runs. The machine is shared and
noisy: compare ratios within one run, not absolute numbers across runs.

    python scripts/bench_decode.py --dtypes float32,bfloat16 --out bench_decode.json
    python scripts/bench_decode.py --new-tokens 16 --repeats 1      # quick development run
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time

import numpy as np

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "models", "smollm2-135m")
TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)


# ---- machine -------------------------------------------------------------------------------------
def tcmalloc_loaded() -> bool:
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            return "tcmalloc" in f.read()
    except OSError:
        return False


def tcmalloc_path() -> str | None:
    return next((p for p in TCMALLOC_CANDIDATES if os.path.exists(p)), None)


def git_state(root: str) -> tuple[str | None, bool | None]:
    """(short commit, whether jaxserve/ has uncommitted changes) of the checkout at `root`; None outside git."""
    import subprocess

    try:
        commit = (
            subprocess.run(
                ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
        dirty = bool(
            subprocess.run(
                ["git", "-C", root, "status", "--porcelain", "--", "jaxserve"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, dirty


def machine_info() -> dict:
    cpu, flags = platform.processor() or "unknown", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and cpu in ("unknown", "", platform.processor()):
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    flags = line
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    import jax
    import torch
    import transformers

    import jaxserve

    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxserve.__file__)))
    commit, dirty = git_state(root)
    return {
        "jaxserve_from": root,
        "jaxserve_commit": commit,
        "jaxserve_dirty": dirty,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "memory_gib": mem_gib,
        "tcmalloc_preloaded": tcmalloc_loaded(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def measure_read_bandwidth(mib: int = 512, repeats: int = 5) -> dict:
    """GB/s of summing a large f32 array (well past the caches), best of `repeats`, per library."""
    import jax
    import jax.numpy as jnp
    import torch

    n = mib * 2**20 // 4
    host = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    out = {}

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return round(n * 4 / min(times) / 1e9, 1)

    out["numpy_sum_gbps"] = best(lambda: host.sum())
    th = torch.from_numpy(host)
    out["torch_sum_gbps"] = best(lambda: th.sum().item())
    dev = jax.device_put(host)
    jsum = jax.jit(jnp.sum)
    out["jax_sum_gbps"] = best(lambda: jsum(dev).block_until_ready())
    out["best_gbps"] = max(out.values())
    del host, th, dev
    gc.collect()
    return out


# ---- timing helpers ------------------------------------------------------------------------------
def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def summarize(t1: list[float], tn: list[float], n: int) -> dict:
    """TTFT and per-token decode time (ms) from the 1-token and n-token generate times (s)."""
    m1, mn = statistics.median(t1), statistics.median(tn)
    decode_ms = (mn - m1) / (n - 1) * 1e3
    return {
        "ttft_ms": m1 * 1e3,
        "total_ms": mn * 1e3,
        "decode_ms_per_token": decode_ms,
        "decode_tokens_per_s": 1e3 / decode_ms if decode_ms > 0 else float("nan"),
        "raw_1_token_s": t1,
        "raw_n_tokens_s": tn,
    }


# ---- jaxserve ------------------------------------------------------------------------------------
def bench_jaxserve(args, dtype: str, prompt: list[int]) -> tuple[dict, object, list[int]]:
    """Returns (results, params as a host numpy pytree, greedy tokens)."""
    import logging

    import jax
    import jax.numpy as jnp
    from jaxserve import LLM, SamplingParams
    from jaxserve.model.weights import param_bytes

    n = args.new_tokens
    max_len = len(prompt) + n
    # No bucket-table warm-up: the full table is dozens of compilations, while this benchmark runs a
    # handful of shapes; the untimed warm-up generate below compiles exactly those.
    t_build, llm = timed(
        lambda: LLM(
            model=args.model,
            load_format="dummy",
            dtype=dtype,
            seed=args.seed,
            max_num_seqs=1,
            max_num_batched_tokens=len(prompt),
            max_model_len=max_len,
            warm_up=False,
            # Every timed run sends the same prompt: with prefix caching its pages would be reused and the
            # "TTFT" would skip the prefill it is meant to measure.
            enable_prefix_caching=False,
        )
    )
    logging.getLogger("jaxserve.runner.runner").setLevel(logging.ERROR)  # "compiling unplanned shape"
    runner = llm.runner
    sp1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    spn = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    quiet = {"use_tqdm": False} if "use_tqdm" in inspect.signature(llm.generate).parameters else {}
    gen = lambda sp: llm.generate(prompt_token_ids=[prompt], sampling_params=sp, **quiet)[0].outputs[0].token_ids
    t_first, _ = timed(lambda: (gen(sp1), gen(spn)))  # warm-up (compiles), not timed
    compiled = runner.unplanned_compiles
    t1, tn, tokens = [], [], None
    for _ in range(args.repeats):
        t, _ = timed(lambda: gen(sp1))
        t1.append(t)
        t, tokens = timed(lambda: gen(spn))
        tn.append(t)
    res = {"llm_generate": summarize(t1, tn, n)}
    res["param_bytes"] = param_bytes(runner.params)
    res["build_s"] = t_build
    res["warm_up_generate_s"] = t_first
    res["step_shapes_compiled"] = compiled
    res["plan"] = llm.memory.describe()
    if runner.unplanned_compiles != compiled:
        print(f"  warning: {runner.unplanned_compiles - compiled} compiles inside the timed runs", file=sys.stderr)

    try:
        res.update(bench_steps(args, llm, tokens[0], len(prompt), max_len))
    except Exception as err:  # the runner's internals move; the generate numbers above still stand
        print(f"  raw-step timing unavailable: {err!r}", file=sys.stderr)
        res["raw_step_error"] = repr(err)

    try:
        res["prompt_logits"] = prompt_logits(llm, prompt, jnp.dtype(dtype))
    except Exception as err:
        print(f"  prompt-logits check unavailable: {err!r}", file=sys.stderr)

    host_params = jax.tree.map(np.asarray, runner.params)
    del llm, runner
    gc.collect()
    return res, host_params, list(tokens)


def bench_steps(args, llm, token: int, start: int, max_len: int) -> dict:
    """Decode below LLM.generate: `ModelRunner.execute` on a prepared row (host packing + compiled step
    + token fetch), and the compiled executable alone on device-resident inputs, synced every step
    (as decode must be, to feed the token back) and pipelined (no sync: the device-time floor)."""
    from jaxserve.runner.step_row import StepRow
    from jaxserve.runner.step_timing import capture_step, time_step

    runner = llm.runner
    page_ids = list(range(1, math.ceil(max_len / llm.memory.page_size) + 1))  # page 0 is the padding page
    row = lambda tok, pos: StepRow([tok], pos, page_ids)

    def runner_loop(steps: int) -> float:
        tok = token
        t = time.perf_counter()
        for i in range(steps):
            tok = first_token(runner.execute_rows([row(tok, start + i)]))
        return (time.perf_counter() - t) / steps

    # The exact executable and arguments the runner hands XLA for this row (jaxserve.runner.step_timing).
    step = capture_step(runner, [row(token, start)])
    shape = step.shape

    def step_loop(steps: int, sync: bool) -> float:
        return sum(time_step(runner, step, steps, sync)) / steps

    runner_loop(4), step_loop(4, True), step_loop(4, False)  # warm-up
    steps = args.step_iters
    r_runner = [runner_loop(steps) for _ in range(args.repeats)]
    r_sync = [step_loop(steps, True) for _ in range(args.repeats)]
    r_async = [step_loop(steps, False) for _ in range(args.repeats)]
    entry = lambda raw: {
        "decode_ms_per_token": statistics.median(raw) * 1e3,
        "decode_tokens_per_s": 1 / statistics.median(raw),
        "raw_s": raw,
    }
    return {
        "step_shape": list(shape),
        "runner_execute": entry(r_runner),
        "compiled_step": entry(r_sync),
        "compiled_step_pipelined": entry(r_async),
    }


def first_token(sampled) -> int:
    """Row 0's token from `ModelRunner.execute` (an array of tokens, or a sample with `.tokens`)."""
    return int(np.ravel(getattr(sampled, "tokens", sampled))[0])


def prompt_logits(llm, prompt: list[int], dtype) -> np.ndarray:
    """Last-position logits of the prompt, for the numerical check against HF. Scanned layers: the same
    math as the unrolled step at a fraction of the compile time."""
    from jaxserve import steps
    from jaxserve.model.kv_cache import StepBatch, init_cache

    need = math.ceil(len(prompt) / llm.memory.page_size)
    batch = StepBatch(
        tokens=np.array([[prompt]], np.int32),
        start_pos=np.zeros((1, 1), np.int32),
        num_new=np.full((1, 1), len(prompt), np.int32),
        page_table=np.arange(1, need + 1, dtype=np.int32)[None, None],
    )
    cache = init_cache(llm.model_config, need + 1, llm.memory.page_size, dtype)
    logits, _ = steps.prefill_nodonate(
        llm.runner.params, cache, batch, cfg=llm.model_config, options=steps.StepOptions(scan_layers=True)
    )
    return np.asarray(logits, np.float32)[0, 0]


# ---- Hugging Face --------------------------------------------------------------------------------
def hf_state_dict(params, cfg) -> dict:
    """jaxserve params (linear weights [in, out], layers stacked on axis 0) -> LlamaForCausalLM state dict."""
    import torch

    def t(x) -> torch.Tensor:
        return torch.from_numpy(np.array(x, dtype=np.float32, order="C"))  # a writable copy

    L = params.layers
    if isinstance(L, tuple):  # per-layer arrays (the unrolled engine's form): stack them back
        import jax

        L = jax.tree.map(lambda *ws: np.stack([np.asarray(w) for w in ws]), *L)
    sd = {"model.embed_tokens.weight": t(params.embed), "model.norm.weight": t(params.final_norm)}
    if params.lm_head is not None:
        sd["lm_head.weight"] = t(np.asarray(params.lm_head).T)
    names = {
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj",
        "w_gate": "mlp.gate_proj",
        "w_up": "mlp.up_proj",
        "w_down": "mlp.down_proj",
    }
    biases = {"bq": "self_attn.q_proj", "bk": "self_attn.k_proj", "bv": "self_attn.v_proj", "bo": "self_attn.o_proj"}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = t(L.attn_norm[i])
        sd[p + "post_attention_layernorm.weight"] = t(L.mlp_norm[i])
        for ours, theirs in names.items():
            sd[p + theirs + ".weight"] = t(np.asarray(getattr(L, ours)[i]).T)  # [in, out] -> [out, in]
        for ours, theirs in biases.items():
            b = getattr(L, ours)
            if b is not None:
                sd[p + theirs + ".bias"] = t(b[i])
    return sd


def build_hf(args, params, dtype: str):
    import torch
    import transformers
    from jaxserve.config import ModelConfig

    cfg = ModelConfig.from_dir(args.model)
    hf_cfg = transformers.AutoConfig.from_pretrained(args.model)
    model = transformers.LlamaForCausalLM(hf_cfg)
    missing, unexpected = model.load_state_dict(hf_state_dict(params, cfg), strict=False)
    allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model = model.to(getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as ignore_eos does
    model.generation_config.pad_token_id = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
    return model


def bench_hf(args, model, prompt: list[int]) -> tuple[dict, list[int]]:
    import torch

    n = args.new_tokens
    ids = torch.tensor([prompt], dtype=torch.long)
    mask = torch.ones_like(ids)

    def gen(k: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False, num_beams=1
            )
        return out[0, len(prompt) :].tolist()

    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask).logits[0, -1].float().numpy()
    gen(1), gen(n)  # warm-up
    t1, tn, tokens = [], [], None
    for _ in range(args.repeats):
        t, _ = timed(lambda: gen(1))
        t1.append(t)
        t, tokens = timed(lambda: gen(n))
        tn.append(t)
    return {"hf_generate": summarize(t1, tn, n), "prompt_logits": logits}, tokens


def compare_logits(ours: np.ndarray, ref: np.ndarray, k: int = 5) -> dict:
    top = lambda x: np.argsort(-x)[:k].tolist()
    return {
        "max_abs_diff": float(np.max(np.abs(ours - ref))),
        "ref_std": float(np.std(ref)),
        f"top{k}_ours": top(ours),
        f"top{k}_hf": top(ref),
        f"top{k}_same": top(ours) == top(ref),
    }


# ---- report --------------------------------------------------------------------------------------
def agreement(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def print_table(report: dict) -> None:
    bw = report.get("bandwidth", {}).get("best_gbps")
    rows = []
    for dtype, r in report["results"].items():
        pbytes = r["jaxserve"]["param_bytes"]
        hf_ms = r.get("hf", {}).get("hf_generate", {}).get("decode_ms_per_token")
        labels = {
            "llm_generate": "jaxserve LLM.generate",
            "runner_execute": "jaxserve runner.execute",
            "compiled_step": "jaxserve compiled step",
            "compiled_step_pipelined": "jaxserve step pipelined",
        }
        entries = [(label, r["jaxserve"][key]) for key, label in labels.items() if key in r["jaxserve"]]
        if "hf" in r:
            entries.append(("HF transformers generate", r["hf"]["hf_generate"]))
        for name, e in entries:
            ms = e["decode_ms_per_token"]
            gbps = pbytes / (ms / 1e3) / 1e9
            rows.append(
                (
                    dtype,
                    name,
                    f"{ms:8.2f}",
                    f"{1e3 / ms:7.1f}",
                    f"{e['ttft_ms']:8.1f}" if "ttft_ms" in e else "       -",
                    f"{gbps:6.1f}",
                    f"{100 * gbps / bw:5.0f}%" if bw else "    -",
                    f"{hf_ms / ms:5.2f}x" if hf_ms else "    -",
                )
            )
    head = ("dtype", "what", "ms/token", "tok/s", "TTFT ms", "GB/s", "of BW", "vs HF")
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    line = lambda xs: "  ".join(
        str(x).rjust(w) if i > 1 else str(x).ljust(w) for i, (x, w) in enumerate(zip(xs, widths))
    )
    print()
    print(line(head))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))
    if bw:
        print(
            f"\nGB/s = param bytes / decode time; 'of BW' is against the measured read bandwidth {bw} GB/s; "
            "'vs HF' = HF ms/token / this ms/token (higher is faster)."
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.normpath(DEFAULT_MODEL), help="directory with a config.json")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median reported)")
    ap.add_argument("--step-iters", type=int, default=32, help="steps per timed run of the raw-step loops")
    ap.add_argument("--seed", type=int, default=0, help="seed of the dummy weights and of the prompt")
    ap.add_argument("--check-tokens", type=int, default=8, help="greedy tokens compared with HF in float32")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-bandwidth", action="store_true")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2")

    if not tcmalloc_loaded():
        lib = tcmalloc_path() or "libtcmalloc_minimal.so.4"
        print(
            f"hint: tcmalloc is not preloaded; XLA CPU temporaries are slower on glibc malloc. Run with\n"
            f"  LD_PRELOAD={lib} python {' '.join(sys.argv)}\n"
            f"  (Debian/Ubuntu: apt-get install libtcmalloc-minimal4)",
            file=sys.stderr,
        )

    import torch
    from jaxserve.config import ModelConfig

    cfg = ModelConfig.from_dir(args.model)
    prompt = np.random.default_rng(args.seed).integers(1, cfg.vocab_size, args.prompt_len).tolist()
    report = {"args": vars(args), "machine": machine_info()}
    m = report["machine"]
    print(
        f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; jax {m['jax']}, torch {m['torch']} "
        f"({m['torch_threads']} threads), transformers {m['transformers']}; tcmalloc preloaded: {m['tcmalloc_preloaded']}"
    )
    print(
        f"jaxserve from {m['jaxserve_from']} (commit {m['jaxserve_commit']}{', modified' if m['jaxserve_dirty'] else ''}); "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    report["machine"]["load_average_start"] = os.getloadavg()
    if not args.skip_bandwidth:
        report["bandwidth"] = measure_read_bandwidth()
        print(f"read bandwidth (512 MiB f32 sum, best of 5): {report['bandwidth']}")

    report["results"] = {}
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        print(f"\n== {dtype}: jaxserve", flush=True)
        js, params, js_tokens = bench_jaxserve(args, dtype, prompt)
        entry = {"jaxserve": js, "jaxserve_tokens": js_tokens}
        if args.skip_hf:
            js.pop("prompt_logits")
        step_ms = js.get("compiled_step", {}).get("decode_ms_per_token", float("nan"))
        print(
            f"  generate {js['llm_generate']['decode_ms_per_token']:.2f} ms/token, compiled step {step_ms:.2f} ms; "
            f"first (compiling) generate {js['warm_up_generate_s']:.1f} s",
            flush=True,
        )
        if not args.skip_hf:
            print(f"== {dtype}: HF transformers", flush=True)
            model = build_hf(args, params, dtype)
            del params
            gc.collect()
            hf, hf_tokens = bench_hf(args, model, prompt)
            del model
            gc.collect()
            check = compare_logits(js.pop("prompt_logits"), hf.pop("prompt_logits"))
            entry["logits_check"] = check
            print(
                f"  prompt logits vs HF: max |diff| {check['max_abs_diff']:.2e} (logit std {check['ref_std']:.2e}), "
                f"top-5 same: {check['top5_same']}",
                flush=True,
            )
            k = min(args.check_tokens, len(js_tokens))
            same = agreement(js_tokens, hf_tokens)
            entry.update(hf=hf, hf_tokens=hf_tokens, greedy_agreement=same)
            status = (
                "OK" if same >= k else ("MISMATCH" if dtype == "float32" else "diverges (expected in low precision)")
            )
            print(
                f"  greedy check: first {same} of {len(js_tokens)} tokens agree with HF "
                f"(jaxserve {js_tokens[:k]}, HF {hf_tokens[:k]}) -> {status}",
                flush=True,
            )
            if dtype == "float32":
                entry["greedy_check_ok"] = same >= k and check["top5_same"]
        report["results"][dtype] = entry

    report["machine"]["load_average_end"] = os.getloadavg()
    print_table(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.out}")
    if any(r.get("greedy_check_ok") is False for r in report["results"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
