#!/usr/bin/env python
"""Roofline of the engine's steps: achieved step time against the memory and compute bounds.

On jax's default backend (the CPU here, a GPU or TPU where jax sees one) it

1. measures read bandwidth (a jitted sum over a large array, best of a few) several times during the
   run, since a shared machine drifts, and reports the range; and the matmul peak (a jitted square
   matmul in the model's dtype);
2. builds the engine (`LLM(..., warm_up=False)`, dummy weights) and times its real compiled steps
   (the runner's bucketed `_generate_step` executables, model + sampling, fetched to the host after
   every call as a decode loop must) for decode at every batch x context, and prefill of B prompts;
3. compares each point with the planner's bounds (`jaxserve.planning.roofline`): decode is bound by
   (param bytes + B x context x KV bytes per token) / bandwidth, prefill by FLOPs / peak; reports the
   fraction of the bound reached and the batch where decode turns from memory- to compute-bound
   (by the bounds, and where the measured step time doubles its batch-1 time);
4. profiles batch-1 decode: the same step without sampling, without attention, the weight matmuls
   alone, and the engine's `ModelRunner.execute` around it, so the gap to the bound is split into parts;
5. writes JSON and a PNG (step time vs batch with both bounds, one line per context).

    flock /tmp/jaxserve-bench.lock python scripts/roofline.py --out-dir out/roofline      # ~10 min, CPU
    python scripts/roofline.py --quick                                                   # smoke run
    python scripts/roofline.py --dtype bfloat16 --batches 1,4,16,64,256 --contexts 128,1024   # a GPU

Timings are medians over calls after a warm-up. Compile time is not timed (every bucket is compiled
up front through `ModelRunner.warm_up`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_decode's tcmalloc helpers
if ROOT not in sys.path:  # jaxserve and pallas_kernels from this checkout when not installed
    sys.path.insert(1, ROOT)
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "smollm2-135m-dummy.yaml")
KNEE_FACTOR = 2.0  # the measured turn: where the step takes this many times its batch-1 time
TINY_MODEL = {  # --quick: a 2-layer Llama, compiles in a second or two
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


# ---- pure functions of numbers (tests/test_roofline.py) ----------------------------------------------
def range_summary(samples: Sequence[float]) -> dict:
    """min / median / max of repeated measurements and the spread (max / min - 1) in percent."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("no samples")
    return {
        "n": len(xs),
        "min": xs[0],
        "median": statistics.median(xs),
        "max": xs[-1],
        "spread_pct": 100.0 * (xs[-1] / xs[0] - 1.0) if xs[0] > 0 else float("inf"),
        "samples": list(samples),
    }


def fraction_of_bound(bound_s: float, achieved_s: float) -> float:
    """How close a step came to its bound: bound time / achieved time (1 = at the roofline)."""
    if achieved_s <= 0:
        raise ValueError(f"achieved time must be positive, got {achieved_s}")
    return bound_s / achieved_s


@dataclasses.dataclass(frozen=True)
class Roof:
    """What the bounds need: the model, the bytes it reads, and the measured machine."""

    cfg: Any  # jaxserve.config.ModelConfig
    param_bytes: int  # read once per step (plan.param_bytes_per_device)
    kv_bytes_per_token: int
    activation_bytes: int
    bandwidth: float  # bytes/s
    peak_flops: float  # FLOP/s


def _target(roof: Roof):
    from jaxserve.planning.devices import DEVICES
    from jaxserve.planning.roofline import Target

    spec = dataclasses.replace(DEVICES["cpu"], name="measured", description="measured here", shared_host=False)
    return Target.build(spec, (1, 1), device_memory=1, bandwidth=roof.bandwidth, peak_flops=roof.peak_flops)


def decode_bound(roof: Roof, batch: int, context: int) -> dict:
    """The planner's decode bound (`plan.decode_bound`) for `batch` sequences attending to `context` tokens."""
    from jaxserve.planning import roofline as plan

    b = plan.decode_bound(
        roof.cfg, _target(roof), roof.param_bytes, roof.kv_bytes_per_token, batch, context, roof.activation_bytes
    )
    return _bound_dict(
        b.memory_s,
        b.compute_s,
        b.seconds,
        bytes_read=roof.param_bytes + batch * context * roof.kv_bytes_per_token,
        flops=b.compute_s * roof.peak_flops,
    )


def prefill_bound(roof: Roof, batch: int, prompt_len: int) -> dict:
    """Prefill of `batch` prompts of `prompt_len` tokens from an empty cache: `plan.prefill_bound`'s
    arithmetic (FLOPs / peak against weights + new KV / bandwidth) with batch x the tokens."""
    from jaxserve.planning import roofline as plan

    cfg, tokens = roof.cfg, batch * prompt_len
    bytes_read = roof.param_bytes + tokens * roof.kv_bytes_per_token
    flops = plan.matmul_flops(plan.matmul_params(cfg), tokens) + plan.attention_flops(
        cfg.num_heads, cfg.head_dim, cfg.num_layers, tokens, (prompt_len + 1) / 2
    )
    memory_s = plan.memory_bound_seconds(bytes_read, roof.bandwidth)
    compute_s = plan.compute_bound_seconds(flops, roof.peak_flops)
    return _bound_dict(memory_s, compute_s, plan.step_seconds(memory_s, compute_s, 0.0), bytes_read, flops)


def _bound_dict(memory_s: float, compute_s: float, bound_s: float, bytes_read: float, flops: float) -> dict:
    return {
        "memory_s": memory_s,
        "compute_s": compute_s,
        "bound_s": bound_s,
        "bound_by": "compute" if compute_s > memory_s else "memory",
        "bytes_read": bytes_read,
        "flops": flops,
    }


def crossover_batch(roof: Roof, context: int) -> float | None:
    """The batch at which the decode bounds meet: memory_s(B) = compute_s(B), i.e.
    (P + B·C·kv) / bw = (2·P_mm·B + 4·N·H·L·B·C) / peak. None when decode never turns compute-bound
    at this context (each sequence's KV costs more to read than its FLOPs to compute)."""
    from jaxserve.planning import roofline as plan

    cfg = roof.cfg
    flops_per_seq = plan.matmul_flops(plan.matmul_params(cfg), 1) + plan.attention_flops(
        cfg.num_heads, cfg.head_dim, cfg.num_layers, 1, context
    )
    per_seq = flops_per_seq / roof.peak_flops - context * roof.kv_bytes_per_token / roof.bandwidth
    if per_seq <= 0:
        return None
    return (roof.param_bytes / roof.bandwidth) / per_seq


def first_compute_bound(points: Sequence[dict]) -> int | None:
    """The smallest batch of `points` (dicts with batch, bound_by) whose bound is compute; None if none."""
    batches = [p["batch"] for p in points if p["bound_by"] == "compute"]
    return min(batches) if batches else None


def measured_knee(batches: Sequence[int], seconds: Sequence[float], factor: float = KNEE_FACTOR) -> float | None:
    """Where the measured step time reaches `factor` x its smallest-batch time (log-log interpolated).

    A memory-bound step costs about the same at any batch (the weights are read once); past this
    batch the per-sequence work costs as much as that fixed read: the measured memory -> compute turn.
    None if the time never reaches it in the range measured."""
    pairs = sorted(zip(batches, seconds))
    if not pairs:
        return None
    base = pairs[0][1] * factor
    for (b0, t0), (b1, t1) in zip(pairs, pairs[1:]):
        if t1 >= base:
            if t0 >= base:
                return float(b0)
            # log t is linear in log b between the two points
            w = (math.log(base) - math.log(t0)) / (math.log(t1) - math.log(t0))
            return float(math.exp(math.log(b0) + w * (math.log(b1) - math.log(b0))))
    return None


# The profile's variants, each the previous one plus one part: (variant, the part it adds).
PROFILE_PARTS = (
    ("weight_matmuls", "weight matmuls alone (every linear layer and the LM head at batch 1)"),
    ("model_no_attention", "rest of the layers: embedding, norms, RoPE, KV-cache writes, residuals"),
    ("model", "paged attention"),
    ("step_pipelined", "sampling (softmax, top-k logprobs) in the step"),
    ("step_synced", "waiting for each step and fetching its samples"),
    ("engine_execute", "engine host work: packing rows, host-to-device copies, dispatch"),
)


def breakdown(times_s: dict) -> list[dict]:
    """Split the full step time into parts from nested variants (each one the previous plus a part):
    part i = time(variant i) - time(variant i - 1). Noise can make a small part negative; kept as
    measured. Shares are of the last variant's time."""
    rows, prev = [], 0.0
    present = [(k, what) for k, what in PROFILE_PARTS if k in times_s]
    total = times_s[present[-1][0]] if present else 0.0
    for key, what in present:
        part = times_s[key] - prev
        rows.append(
            {"variant": key, "part": what, "ms": part * 1e3, "share": part / total if total > 0 else float("nan")}
        )
        prev = times_s[key]
    return rows


# ---- machine measurements on jax's default backend ---------------------------------------------------
class Machine:
    """Read bandwidth and matmul peak, measured on jax's default backend; bandwidth is resampled
    through the run (`sample_bandwidth`) and the range kept."""

    def __init__(self, bandwidth_mib: int, repeats: int, matmul_n: int, dtype: str):
        import jax
        import jax.numpy as jnp

        self.backend = jax.default_backend()
        self.repeats = repeats
        n = bandwidth_mib * 2**20 // 4
        self._data = jax.block_until_ready(jnp.ones((n // 1024, 1024), jnp.float32))
        self._sum = jax.jit(jnp.sum)
        self._row = jnp.ones((1, n // 1024), jnp.float32)
        self._matvec = jax.jit(lambda r, d: r @ d)
        if self.backend == "cpu":
            from concurrent.futures import ThreadPoolExecutor

            self._host = np.ones(n, np.float32)  # a separate copy (the device array may alias)
            self._chunks = np.array_split(self._host, 4 * (os.cpu_count() or 1))
            self._pool = ThreadPoolExecutor(os.cpu_count() or 1)
        self.bandwidth_samples: list[dict] = []
        self.matmul_n, self.dtype = matmul_n, dtype
        a = jax.block_until_ready(jax.random.normal(jax.random.key(0), (matmul_n, matmul_n), jnp.dtype(dtype)))
        self._a = a
        self._mm = jax.jit(lambda x: x @ x)
        self.peak_samples: list[float] = []

    def _best(self, fn) -> float:
        import jax

        jax.block_until_ready(fn())
        best = float("inf")
        for _ in range(self.repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            best = min(best, time.perf_counter() - t)
        return best

    def sample_bandwidth(self, when: str) -> float:
        """One sample: the best read rate (bytes/s) of a few ways to stream the array once, each best
        of `repeats`: a jitted sum, a jitted [1, K] x [K, N] matmul (decode's access pattern) and, on
        a CPU, numpy sums on every core (XLA may reduce on one thread)."""
        nbytes = self._data.size * 4
        entry: dict[str, Any] = {"when": when}
        entry["jax_sum_gbps"] = nbytes / self._best(lambda: self._sum(self._data)) / 1e9
        entry["jax_matvec_gbps"] = nbytes / self._best(lambda: self._matvec(self._row, self._data)) / 1e9
        if self.backend == "cpu":
            entry["numpy_threads_sum_gbps"] = (
                nbytes / self._best(lambda: sum(self._pool.map(np.sum, self._chunks))) / 1e9
            )
            # the planner's own measurement (devices.measure_copy_bandwidth: read + write), for reference
            from jaxserve.planning.devices import measure_copy_bandwidth

            entry["numpy_copy_gbps"] = measure_copy_bandwidth(256, self.repeats) / 1e9
        entry["gbps"] = max(v for k, v in entry.items() if k.endswith("_gbps") and k != "numpy_copy_gbps")
        entry["load_average"] = os.getloadavg()[0]
        entry["time"] = time.time()
        self.bandwidth_samples.append(entry)
        return entry["gbps"] * 1e9

    def sample_peak(self) -> float:
        """FLOP/s of a jitted n x n matmul in the model's dtype, best of `repeats`."""
        flops = 2 * self.matmul_n**3 / self._best(lambda: self._mm(self._a))
        self.peak_samples.append(flops)
        return flops

    @property
    def bandwidth(self) -> dict:
        return range_summary([s["gbps"] for s in self.bandwidth_samples])

    def release(self) -> None:
        del self._data, self._a, self._row
        if self.backend == "cpu":
            self._pool.shutdown()
            del self._host, self._chunks


# ---- the engine --------------------------------------------------------------------------------------
def write_tiny_model(directory: str) -> str:
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(TINY_MODEL, f)
    return directory


def build_llm(args, batches: Sequence[int], contexts: Sequence[int], prefill_points: Sequence[tuple[int, int]]):
    """The engine, sized for every point: buckets up to the largest batch and context, and a cache
    holding max batch x max context tokens (each row gets its own pages)."""
    import logging

    from jaxserve import LLM
    from jaxserve.config import EngineConfig

    overrides: dict[str, Any] = {}
    if args.model:
        overrides["model"] = args.model
    if args.dtype:
        overrides["dtype"] = args.dtype
    if args.attention_backend:
        overrides["attention_backend"] = args.attention_backend
    if args.load_format:
        overrides["load_format"] = args.load_format
    base = EngineConfig.from_yaml(args.config, overrides) if args.config else EngineConfig.from_dict(overrides)
    page = base.page_size
    max_ctx = max(list(contexts) + [c for _, c in prefill_points])
    pages = max(
        max(batches) * math.ceil(max(contexts) / page), max([b * math.ceil(c / page) for b, c in prefill_points] or [0])
    )
    settings = base.to_dict()
    settings.update(
        max_num_seqs=max(list(batches) + [b for b, _ in prefill_points]),
        max_model_len=max_ctx,
        max_num_batched_tokens=max([c for _, c in prefill_points] or [16]),
        num_pages=pages + 1,
        kv_cache_memory=None,
        enable_prefix_caching=False,
        speculative_model=None,
        num_speculative_tokens=0,
    )
    if args.no_compilation_cache:
        settings["compilation_cache_dir"] = "none"
    model = settings.pop("model")
    llm = LLM(model=model, warm_up=False, **settings)
    logging.getLogger("jaxserve.runner.runner").setLevel(logging.ERROR)
    return llm


def decode_rows(batch: int, context: int, page_size: int, token: int = 1):
    """`batch` rows each decoding the token at position context - 1 (so it attends to `context` tokens)."""
    from jaxserve.runner.step_row import StepRow

    n = math.ceil(context / page_size)
    return [StepRow([token], context - 1, list(range(1 + b * n, 1 + (b + 1) * n))) for b in range(batch)]


def prefill_rows(batch: int, prompt_len: int, page_size: int, vocab: int, seed: int = 0):
    from jaxserve.runner.step_row import StepRow

    n = math.ceil(prompt_len / page_size)
    rng = np.random.default_rng(seed)
    return [
        StepRow(rng.integers(1, vocab, prompt_len).tolist(), 0, list(range(1 + b * n, 1 + (b + 1) * n)))
        for b in range(batch)
    ]


def shape_of(runner, rows) -> tuple[int, int]:
    """The ragged (tokens, pages) bucket `ModelRunner.execute` picks for these rows (one replica)."""
    from jaxserve.engine.buckets import pick_step_shape

    ps = runner.cache.page_size
    pages = max(-(-(r.start_pos + len(r.tokens)) // ps) for r in rows)
    return pick_step_shape(runner.buckets, sum(len(r.tokens) for r in rows), pages)


def time_point(runner, rows, args) -> dict:
    """Median seconds of the compiled step for these rows, fetched every call (jaxserve.runner.step_timing)."""
    from jaxserve.runner.step_timing import capture_step, time_step

    step = capture_step(runner, rows)  # its two untimed calls are the warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < args.min_iters or (time.perf_counter() - start < args.min_time and len(times) < args.max_iters):
        times += time_step(runner, step, 1)
    return {
        "shape": list(step.shape),
        "seconds": statistics.median(times),
        "min_s": min(times),
        "iters": len(times),
        "raw_s": times,
    }


# ---- the batch-1 decode profile ----------------------------------------------------------------------
def profile_decode(llm, context: int, args) -> dict:
    """Times of nested variants of the batch-1 decode step (see PROFILE_PARTS), each compiled with the
    runner's compiler options on its params and cache; and the weights read alone (a sum over them)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model import quant, ragged_step as step_body
    from jaxserve.model.weights import param_bytes
    from jaxserve.runner.step_timing import capture_step, time_calls, time_step

    runner, cfg = llm.runner, llm.model_config
    rows = decode_rows(1, context, llm.memory.page_size)
    step = capture_step(runner, rows)
    batch = step.inputs[0]
    opts = runner.compiler_options
    iters = args.profile_iters

    def compile_donating(fn):
        return jax.jit(fn, donate_argnums=(1,)).trace(runner.params, runner.cache, batch).lower().compile(opts)

    model = compile_donating(lambda p, c, b: step_body.ragged_step(p, c, b, cfg, runner.options))

    def no_attention(q, *args, **kwargs):
        return q

    real_impl = step_body.ragged_attention_impl
    step_body.ragged_attention_impl = lambda impl, mesh=None: no_attention  # ragged_step looks it up when traced
    try:
        model_no_attention = compile_donating(lambda p, c, b: step_body.ragged_step(p, c, b, cfg, runner.options))
    finally:
        step_body.ragged_attention_impl = real_impl

    def weight_matmuls(params, x):
        L = params.layers
        layers = L if isinstance(L, tuple) else [jax.tree.map(lambda w, i=i: w[i], L) for i in range(cfg.num_layers)]
        for lp in layers:
            q, k, v = quant.matmul(x, lp.wq), quant.matmul(x, lp.wk), quant.matmul(x, lp.wv)
            o = quant.matmul(q, lp.wo)
            d = quant.matmul(quant.matmul(o, lp.w_gate) * quant.matmul(o, lp.w_up), lp.w_down)
            x = jnp.tanh(x + d + k.sum() + v.sum())  # bounded values; k and v kept alive
        if params.lm_head is None:
            return jnp.einsum("...d,vd->...v", x, params.embed, preferred_element_type=jnp.float32)
        return quant.matmul(x, params.lm_head, preferred_element_type=jnp.float32)

    # the weight matmuls alone at batch 1 and at a few larger batches (how XLA's dot scales with rows)
    xs = {
        b: jnp.ones((1, b, cfg.hidden_size), runner.params.embed.dtype)
        for b in (1, 2, 4, 8)
        if b == 1 or b in args.profile_matmul_batches
    }
    matmuls_by_batch = {b: jax.jit(weight_matmuls).trace(runner.params, x).lower().compile(opts) for b, x in xs.items()}
    matmuls, x0 = matmuls_by_batch[1], xs[1]
    read_weights = (
        jax.jit(
            lambda p: sum(
                jnp.sum(w.astype(jnp.float32)) if w.dtype.itemsize < 4 else jnp.sum(w) for w in jax.tree.leaves(p)
            )
        )
        .lower(runner.params)
        .compile(opts)
    )

    def pipelined(call):
        def run() -> float:  # mean seconds per call of `iters` calls queued back to back
            t = time.perf_counter()
            out = None
            for _ in range(iters):
                out = call()
            jax.block_until_ready(out)
            return (time.perf_counter() - t) / iters

        return run

    def run_model(exe):
        def call():
            out, runner.cache = exe(runner.params, runner.cache, batch)
            return out

        return call

    variants = {
        "weight_matmuls": pipelined(lambda: matmuls(runner.params, x0)),
        "model_no_attention": pipelined(run_model(model_no_attention)),
        "model": pipelined(run_model(model)),
        "step_pipelined": pipelined(run_model(lambda p, c, b: step.executable(p, c, *step.inputs))),
        "step_synced": lambda: statistics.mean(time_step(runner, step, iters)),
        "engine_execute": lambda: statistics.mean(time_calls(lambda: runner.execute_rows(rows), iters)),
        "weights_read": pipelined(lambda: read_weights(runner.params)),
    }
    for b, exe in matmuls_by_batch.items():
        if b != 1:
            variants[f"weight_matmuls_batch{b}"] = pipelined(lambda exe=exe, b=b: exe(runner.params, xs[b]))
    # Interleaved rounds, median per variant: the machine's drift hits every variant alike.
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()  # warm-up
    for _ in range(args.profile_rounds):
        for key, fn in variants.items():
            samples[key].append(fn())
    med = {k: statistics.median(v) for k, v in samples.items()}
    times = {k: med[k] for k, _ in PROFILE_PARTS}
    weights_read = med["weights_read"]
    by_batch = {1: med["weight_matmuls"], **{b: med[f"weight_matmuls_batch{b}"] for b in matmuls_by_batch if b != 1}}
    if args.trace:
        with jax.profiler.trace(args.trace):
            for _ in range(4):
                runner.execute_rows(rows)
    pbytes = param_bytes(runner.params)
    return {
        "batch": 1,
        "context": context,
        "times_s": times,
        "breakdown": breakdown(times),
        "weights_read_s": weights_read,
        "weights_read_gbps": pbytes / weights_read / 1e9,
        "weight_matmuls_gbps": pbytes / times["weight_matmuls"] / 1e9,
        "param_bytes": pbytes,
        "weight_matmuls_by_batch_s": by_batch,
        "rounds": args.profile_rounds,
        "iters_per_round": iters,
        "samples_s": samples,
        "trace_dir": args.trace,
    }


# ---- report ------------------------------------------------------------------------------------------
def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    contexts = sorted({p["context"] for p in report["decode"]})
    for i, ctx in enumerate(contexts):
        pts = sorted((p for p in report["decode"] if p["context"] == ctx and "seconds" in p), key=lambda p: p["batch"])
        if not pts:
            continue
        c = colors[i % len(colors)]
        b = [p["batch"] for p in pts]
        ax.plot(b, [p["seconds"] * 1e3 for p in pts], "o-", color=c, label=f"measured, context {ctx}")
        ax.plot(b, [p["memory_s"] * 1e3 for p in pts], "--", color=c, alpha=0.8, label=f"memory bound, context {ctx}")
        ax.plot(b, [p["compute_s"] * 1e3 for p in pts], ":", color=c, alpha=0.8, label=f"compute bound, context {ctx}")
    m = report["machine"]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({p["batch"] for p in report["decode"]}))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("decode batch (sequences per step)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(
        f"{os.path.basename(report['model'].rstrip('/'))} {report['dtype']} decode on {m['device']}\n"
        f"bandwidth {m['bandwidth_gbps']['max']:.1f} GB/s (range {m['bandwidth_gbps']['min']:.1f}-"
        f"{m['bandwidth_gbps']['max']:.1f}), peak {m['peak_gflops']:.0f} GFLOP/s",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(report: dict) -> None:
    m = report["machine"]
    bw = m["bandwidth_gbps"]
    print(f"\n{report['model']} ({report['dtype']}), {m['device']} [{m['backend']}], jax {m['jax']}")
    print(
        f"param bytes {report['param_bytes'] / 2**20:.1f} MiB, KV {report['kv_bytes_per_token']} B/token; "
        f"read bandwidth {bw['min']:.1f}-{bw['max']:.1f} GB/s over {bw['n']} samples (median {bw['median']:.1f}; "
        f"bounds use the max), matmul peak {m['peak_gflops']:.1f} GFLOP/s"
    )
    head = (
        f"{'kind':>7} {'batch':>5} {'ctx':>5} {'bucket':>13} {'ms':>9} {'mem ms':>8} {'cmp ms':>8} {'bound':>7} "
        f"{'of bound':>8} {'tok/s':>9}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for kind in ("decode", "prefill"):
        for p in report[kind]:
            if "seconds" not in p:
                print(f"{kind:>7} {p['batch']:>5} {p['context']:>5}  failed: {p.get('error')}")
                continue
            toks = p["batch"] * (1 if kind == "decode" else p["context"]) / p["seconds"]
            print(
                f"{kind:>7} {p['batch']:>5} {p['context']:>5} {str(tuple(p['shape'])):>13} {p['seconds'] * 1e3:9.2f} "
                f"{p['memory_s'] * 1e3:8.2f} {p['compute_s'] * 1e3:8.2f} {p['bound_by']:>7} "
                f"{100 * p['fraction']:7.1f}% {toks:9.1f}"
            )
    for ctx, c in report["crossover"].items():
        b, knee = c["bound_batch"], c["measured_knee"]
        b = f"batch {b:.1f}" if b else "no batch (its KV reads grow faster than its FLOPs)"
        knee = f"batch {knee:.1f}" if knee else "no batch measured"
        print(
            f"context {ctx}: decode turns compute-bound at {b} by the bounds; the measured step time "
            f"reaches {KNEE_FACTOR:g}x its batch-1 time at {knee}"
        )
    prof = report.get("profile")
    if prof:
        print(
            f"\nbatch-1 decode at context {prof['context']}: where the time goes "
            f"(bound {prof['bound_s'] * 1e3:.2f} ms = {100 * prof['fraction_synced']:.1f}% of the compiled step, "
            f"{100 * prof['fraction_engine']:.1f}% of engine execute)"
        )
        for r in prof["breakdown"]:
            print(f"  {r['ms']:8.2f} ms {100 * r['share']:5.1f}%  {r['part']}")
        print(
            f"  weights read alone (sum over params): {prof['weights_read_s'] * 1e3:.2f} ms "
            f"= {prof['weights_read_gbps']:.1f} GB/s; weight matmuls alone {prof['weight_matmuls_gbps']:.1f} GB/s"
        )
        print(
            "  weight matmuls alone by batch: "
            + ", ".join(f"{b}: {t * 1e3:.2f} ms" for b, t in prof["weight_matmuls_by_batch_s"].items())
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help=f"engine settings YAML (default {os.path.relpath(DEFAULT_CONFIG)})")
    ap.add_argument("--model", help="model directory (overrides the config's)")
    ap.add_argument("--dtype", help="float32 | bfloat16 (default: the config's; auto = float32 on CPU)")
    ap.add_argument("--load-format", help="auto | dummy | ... (default: the config's; dummy = seeded random weights)")
    ap.add_argument("--attention-backend", help="auto | reference | pallas (default: the config's)")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64", help="decode batch sizes")
    ap.add_argument("--contexts", default="128,1024", help="decode contexts (tokens attended) and prompt lengths")
    ap.add_argument("--prefill-batches", default="1,8", help="prompts per prefill step")
    ap.add_argument("--prefill-max-tokens", type=int, default=1024, help="skip prefill points of more tokens")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per point (at least)")
    ap.add_argument("--min-iters", type=int, default=2)
    ap.add_argument("--max-iters", type=int, default=100)
    ap.add_argument("--profile-context", type=int, help="context of the batch-1 profile (default: the first)")
    ap.add_argument("--profile-iters", type=int, default=5, help="calls per variant per round")
    ap.add_argument("--profile-rounds", type=int, default=5, help="interleaved rounds (median per variant)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--trace", help="also write a jax.profiler trace of batch-1 engine steps here (TensorBoard)")
    ap.add_argument("--bandwidth-mib", type=int, help="array size of the bandwidth samples (default 512; 2048 on GPU)")
    ap.add_argument("--bandwidth-repeats", type=int, default=3, help="best of this many sums per sample")
    ap.add_argument("--matmul-size", type=int, help="n of the n x n peak matmul (default 2048; 8192 on accelerators)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: a tiny 2-layer model (unless --model/--config), batches 1,2, contexts 32,64, short timings",
    )
    ap.add_argument("--no-compilation-cache", action="store_true", help="do not use the persistent XLA cache")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "out", "roofline"))
    ap.add_argument("--png", help="plot path (default OUT_DIR/roofline_<backend>_<dtype>.png)")
    args = ap.parse_args(argv)

    tmp = None
    if args.quick:
        if not args.model and not args.config:
            tmp = tempfile.TemporaryDirectory()
            args.model = write_tiny_model(tmp.name)
            args.load_format = "dummy"
        for name, value in (("batches", "1,2"), ("contexts", "32,64"), ("prefill_batches", "1,2")):
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, value)
        args.min_time, args.min_iters, args.profile_iters, args.profile_rounds = 0.05, 2, 2, 2
        args.bandwidth_mib = args.bandwidth_mib or 64
        args.matmul_size = args.matmul_size or 256
        args.bandwidth_repeats = min(args.bandwidth_repeats, 2)
    elif not args.config:
        args.config = DEFAULT_CONFIG
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]
    batches, contexts = sorted(set(ints(args.batches))), ints(args.contexts)
    args.profile_matmul_batches = [b for b in batches if b in (2, 4, 8)]
    prefill_points = [
        (b, c) for c in contexts for b in sorted(set(ints(args.prefill_batches))) if b * c <= args.prefill_max_tokens
    ]

    try:
        from bench_decode import tcmalloc_loaded, tcmalloc_path

        if not tcmalloc_loaded() and tcmalloc_path():
            print(
                f"hint: preload tcmalloc for faster XLA:CPU temporaries: LD_PRELOAD={tcmalloc_path()}", file=sys.stderr
            )
    except ImportError:
        tcmalloc_loaded = lambda: None  # noqa: E731

    import jax

    from jaxserve.planning import roofline as plan
    from jaxserve.model.weights import param_bytes as tree_bytes

    backend = jax.default_backend()
    accel = backend != "cpu"
    t_start = time.perf_counter()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(f"{date}: building the engine ...", flush=True)
    llm = build_llm(args, batches, contexts, prefill_points)
    runner, cfg, settings = llm.runner, llm.model_config, llm.config
    dtype = jax.numpy.dtype(runner.params.embed.dtype).name
    b = plan.DTYPE_BYTES[dtype]
    pbytes = plan.param_bytes_per_device(cfg, b, settings.quantization, settings.quantize_lm_head, 1)
    kv = cfg.kv_bytes_per_token(b, settings.kv_cache_dtype)
    if settings.quantization == "none" and tree_bytes(runner.params) != pbytes:
        print(
            f"note: the engine holds {tree_bytes(runner.params)} param bytes, the planner counts {pbytes}",
            file=sys.stderr,
        )

    machine = Machine(
        args.bandwidth_mib or (2048 if accel else 512),
        args.bandwidth_repeats,
        args.matmul_size or (8192 if accel else 2048),
        dtype,
    )
    machine.sample_bandwidth("start")
    machine.sample_peak()
    print(
        f"bandwidth {machine.bandwidth_samples[-1]['gbps']:.1f} GB/s, matmul peak "
        f"{machine.peak_samples[-1] / 1e9:.1f} GFLOP/s ({dtype}, n={machine.matmul_n})",
        flush=True,
    )

    # Every bucket up front, in parallel (the engine's own warm-up), so nothing compiles while timed.
    page = llm.memory.page_size
    dec = [(bt, c, decode_rows(bt, c, page)) for c in contexts for bt in batches]
    pre = [(bt, c, prefill_rows(bt, c, page, cfg.vocab_size)) for bt, c in prefill_points]
    shapes = sorted({shape_of(runner, rows) for _, _, rows in dec + pre})
    t = time.perf_counter()
    print(f"compiling {len(shapes)} step buckets ...", flush=True)
    runner.warm_up(shapes, progress=False)
    compile_s = time.perf_counter() - t
    print(f"  compiled in {compile_s:.0f} s", flush=True)

    decode, prefill = [], []
    for kind, points, out in (("decode", dec, decode), ("prefill", pre, prefill)):
        for i, (bt, c, rows) in enumerate(points):
            entry: dict[str, Any] = {"batch": bt, "context": c}
            try:
                entry.update(time_point(runner, rows, args))
            except Exception as err:  # noqa: BLE001 - one failed point must not lose the others
                entry["error"] = repr(err)
                print(f"  {kind} batch {bt} context {c}: failed: {err!r}", file=sys.stderr)
            out.append(entry)
            if "seconds" in entry:
                print(f"  {kind} batch {bt:>4} context {c:>5}: {entry['seconds'] * 1e3:9.2f} ms", flush=True)
            if kind == "decode" and (i + 1 == len(points) or points[i + 1][1] != c):
                machine.sample_bandwidth(f"after decode at context {c}")
        machine.sample_bandwidth(f"after {kind}")
    profile = None
    if not args.no_profile:
        ctx = args.profile_context or contexts[0]
        print(f"profiling batch-1 decode at context {ctx} ...", flush=True)
        try:
            profile = profile_decode(llm, ctx, args)
        except Exception as err:  # noqa: BLE001
            print(f"  profile failed: {err!r}", file=sys.stderr)
            profile = {"error": repr(err)}
    machine.sample_bandwidth("end")
    machine.sample_peak()

    bw_range = machine.bandwidth
    bw_best, peak = bw_range["max"] * 1e9, max(machine.peak_samples)
    roof = Roof(cfg, pbytes, kv, b, bw_best, peak)
    roof_low = dataclasses.replace(roof, bandwidth=bw_range["min"] * 1e9)
    for kind, points in (("decode", decode), ("prefill", prefill)):
        bound_fn = decode_bound if kind == "decode" else prefill_bound
        for p in points:
            p.update(bound_fn(roof, p["batch"], p["context"]))
            if "seconds" in p:
                p["fraction"] = fraction_of_bound(p["bound_s"], p["seconds"])
                # with the lowest bandwidth sample: the fraction's range from the drift alone
                p["fraction_at_min_bandwidth"] = fraction_of_bound(
                    bound_fn(roof_low, p["batch"], p["context"])["bound_s"], p["seconds"]
                )
    crossover = {}
    for c in contexts:
        pts = [p for p in decode if p["context"] == c and "seconds" in p]
        crossover[str(c)] = {
            "bound_batch": crossover_batch(roof, c),
            "first_measured_compute_bound": first_compute_bound(pts),
            "measured_knee": measured_knee([p["batch"] for p in pts], [p["seconds"] for p in pts]),
        }
    if profile and "times_s" in profile:
        bound = decode_bound(roof, 1, profile["context"])["bound_s"]
        profile.update(
            bound_s=bound,
            fraction_synced=fraction_of_bound(bound, profile["times_s"]["step_synced"]),
            fraction_engine=fraction_of_bound(bound, profile["times_s"]["engine_execute"]),
            fraction_pipelined=fraction_of_bound(bound, profile["times_s"]["step_pipelined"]),
        )

    dev = jax.devices()[0]
    report = {
        "date": date,
        "command": " ".join([os.path.relpath(sys.argv[0])] + list(argv if argv is not None else sys.argv[1:])),
        "model": settings.model or "",
        "dtype": dtype,
        "config": args.config,
        "attention": runner.options.attention_backend,
        "param_bytes": pbytes,
        "kv_bytes_per_token": kv,
        "machine": {
            "backend": backend,
            "device": dev.device_kind,
            "devices": jax.device_count(),
            "jax": jax.__version__,
            "cpu_cores": os.cpu_count(),
            "host": platform.node(),
            "tcmalloc_preloaded": tcmalloc_loaded(),
            "bandwidth_gbps": bw_range,
            "bandwidth_samples": machine.bandwidth_samples,
            "peak_gflops": peak / 1e9,
            "peak_samples_gflops": [x / 1e9 for x in machine.peak_samples],
            "matmul_n": machine.matmul_n,
            "load_average_end": os.getloadavg(),
        },
        "bound_bandwidth_gbps": bw_best / 1e9,
        "compile_s": compile_s,
        "decode": decode,
        "prefill": prefill,
        "crossover": crossover,
        "profile": profile,
        "elapsed_s": time.perf_counter() - t_start,
    }
    machine.release()
    print_report(report)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"roofline_{backend}_{dtype}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
    png = args.png or os.path.join(args.out_dir, f"roofline_{backend}_{dtype}.png")
    try:
        plot(report, png)
        print(f"wrote {path} and {png}")
    except ImportError as err:
        print(f"wrote {path}; no plot ({err})")
    print(f"elapsed {report['elapsed_s']:.0f} s")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
