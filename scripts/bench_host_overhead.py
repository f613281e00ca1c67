#!/usr/bin/env python
"""Host overhead of the engine's decode loop: the engine's tokens/s against the device-only rate.

For each model and each (batch, context) point it

1. fills the engine with `batch` requests decoding at about `context` tokens (greedy, EOS ignored;
   the prompts are identical and their pages come from the prefix cache, seeded by one request
   first, so that batch 64 x 1024 tokens does not need 64 prefills of 1024 tokens);
2. drives the engine's steps through `LLM.overlap` (engine/overlap.py) as `LLM.generate` does (every
   row decoding, one token per row per step)
   and times each step, split into host phases by wrapping the engine's and the runner's methods on
   their instances (no engine code changes; the wrappers are removed afterwards):

   * schedule    `Scheduler.schedule`
   * pack        building the step inputs: `RunningBatch.apply` (the scheduler's update applied and
                 the rows read out of the batch), `ModelRunner.prepare_inputs` (a plain step
                 writes its bucket's buffer in place, `jaxserve/runner/input_batch.py`) and, for
                 the steps packed from scratch, `Layout.pack` (jaxserve/model/transfer.py)
   * copy        the host->device copy of that buffer where it is a `jax.device_put` of its own
                 (`ModelRunner.put_buffer`); in one process a plain step hands the NumPy buffer to
                 the executable's call, which copies it: there the copy is part of dispatch
   * dispatch    the call of the compiled step's executable (returns before the device is done)
   * wait        fetching the samples processed this step and unpacking them to rows
                 (`PendingSamples.result`: with async scheduling those of the step before, which
                 ran while this step was scheduled and packed)
   * postprocess token handling: placeholders replaced, tokens detokenized, stop checks
   * emit        `LLMEngine._finish_step`: the RequestOutput of every request that advanced
   * other       the rest of the step (step bookkeeping, the generate-style loop over the outputs)

3. calls the very executable of that bucket back to back on the last engine step's packed inputs
   (device-resident), donating the cache as the engine does and blocking only at the end: the
   device-only rate, the ceiling the overlap work aims at;
4. reports engine tokens/s, device-only tokens/s, their ratio, host microseconds per phase per step
   and the bytes copied to the device per step (the packed buffer) and back (the samples).

Engine (with async scheduling off and on, `--async-scheduling`) and device-only timings alternate in
--rounds rounds, so the machine's drift hits all: the rates are medians over rounds, the ratio the
median of the rounds' ratios (with their range). Between modes the engine is flushed
(`Overlap.flush`) and its `async_scheduling` switched: one engine, the same executables. The
timed steps attend at most `context` tokens and stay in one page-count bucket (the JSON gives the
range attended: the prompt is shortened by the measured steps and the rows' admission skew).

A script of its own rather than a mode of scripts/roofline.py: roofline times the compiled step
against the hardware's bounds with no requests in the engine; this one needs the engine full of
requests (prefix cache seeded, every row decoding) and wraps the step loop itself. It borrows
roofline's tiny model for --quick.

    flock /tmp/jaxserve-bench.lock python scripts/bench_host_overhead.py --out out/host_overhead.json
    python scripts/bench_host_overhead.py --models small --batches 1,16 --contexts 128
    python scripts/bench_host_overhead.py --quick                    # tiny model, seconds (the test)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # roofline's tiny model, bench_decode's tcmalloc check
if ROOT not in sys.path:  # jaxserve from this checkout when not installed
    sys.path.insert(1, ROOT)

# name -> (settings YAML, overrides): the shipped 5M model, and the SmolLM2-135M shape (dummy weights).
MODELS = {
    "small": (os.path.join(ROOT, "configs", "small.yaml"), {"model": os.path.join(ROOT, "checkpoints", "small")}),
    "smollm2-135m": (os.path.join(ROOT, "configs", "smollm2-135m-dummy.yaml"), {"dtype": "float32"}),
}
PHASES = ("schedule", "pack", "copy", "dispatch", "wait", "postprocess", "emit", "other")


# ---- pure functions (tests/test_bench_host_overhead.py) -----------------------------------------------
def phase_split(marks: dict[str, float], total: float) -> dict[str, float]:
    """Seconds per phase of one step from the summed wrapped intervals (see the module docstring);
    `other` is what the wrapped calls do not cover (negative only if the intervals overlap: a bug)."""
    phases = {p: marks.get(p, 0.0) for p in PHASES if p != "other"}
    phases["other"] = total - sum(phases.values())
    return phases


def prompt_length(context: int, span: int) -> int:
    """Prompt tokens so that `span` more decode steps stay within `context` tokens (its last step
    attends exactly `context`): context - span - 1 (the first sample comes with the prefill)."""
    return context - span - 1


def decode_steps(args) -> int:
    """Decode steps each row takes at one point: the warm-up, then per round and engine mode one
    untimed step (it fills the async pipeline) and the timed steps."""
    return args.warmup_steps + args.rounds * len(args.modes) * (args.steps + 1)


def admission_skew(batch: int, budget: int, min_chunk: int) -> int:
    """Tokens the first-admitted rows may run ahead of the last: the tails of `batch` prompts enter
    at most budget // min_chunk rows per step while the rows already in decode (a bound for the
    mixed steps as for the alternating ones it was written for)."""
    per_step = max(1, budget // min_chunk)
    return 2 * math.ceil(batch / per_step) + 2


def summarize_point(
    batch: int,
    step_s: list[float],
    round_engine_s: list[float],
    round_device_s: list[float],
    steps: int,
    phases: list[dict[str, float]],
) -> dict:
    """Rates, ratio and mean microseconds per phase from one point's raw timings.

    round_engine_s / round_device_s: seconds of `steps` engine steps / device-only calls per round."""
    engine = [batch * steps / t for t in round_engine_s]
    device = [batch * steps / t for t in round_device_s]
    ratios = [e / d for e, d in zip(engine, device)]
    mean_us = {p: 1e6 * statistics.fmean(ph[p] for ph in phases) for p in PHASES}
    step_us = 1e6 * statistics.fmean(step_s)
    return {
        "engine_tokens_per_s": statistics.median(engine),
        "device_tokens_per_s": statistics.median(device),
        # each round's engine rate over the device-only rate measured right after it: the pairs
        # share the machine's state, so their median is steadier than a ratio of medians
        "ratio": statistics.median(ratios),
        "ratio_of_medians": statistics.median(engine) / statistics.median(device),
        "ratio_range": [min(ratios), max(ratios)],
        "ratio_per_round": ratios,
        "engine_tokens_per_s_per_round": engine,
        "device_tokens_per_s_per_round": device,
        "step_us": step_us,
        "step_us_median": 1e6 * statistics.median(step_s),
        "device_step_us": 1e6 * statistics.median(round_device_s) / steps,
        # host work proper: the step less dispatch and wait (on a CPU the executable's call may run
        # part of the computation before it returns, so dispatch is not counted as host time)
        "phases_us": mean_us,
        "host_us": step_us - mean_us["wait"] - mean_us["dispatch"],
        "raw_step_s": step_s,
    }


# ---- timing hooks (wrapping instances' methods; nothing changes in the engine) -----------------------
class StepTimer:
    """Wraps an engine's scheduler, row building, runner and executables on their instances, and
    collects the summed seconds of each phase of the current step in `marks`."""

    def __init__(self, engine, steps):
        self.engine, self.runner, self.steps = engine, engine.runner, steps  # steps: the LLM's Overlap
        self.marks: dict[str, float] = {}
        self.last: dict[str, Any] = {}  # the last step's plan, bucket, packed buffer, fetched bytes
        self._patched: list[tuple[Any, str]] = []
        self._executables: dict = {}
        self._restore: list = []

    def _add(self, phase: str, seconds: float) -> None:
        self.marks[phase] = self.marks.get(phase, 0.0) + seconds

    def _patch(self, obj, name: str, make) -> None:
        setattr(obj, name, make(getattr(obj, name)))
        self._patched.append((obj, name))

    def install(self) -> "StepTimer":
        import jax

        pc = time.perf_counter
        eng, run = self.engine, self.runner

        def timed(phase, keep=None):
            def make(fn):
                def wrapper(*a, **k):
                    t = pc()
                    out = fn(*a, **k)
                    self._add(phase, pc() - t)
                    if keep:
                        self.last[keep] = out
                    return out

                return wrapper

            return make

        self._patch(eng.scheduler, "schedule", timed("schedule", keep="plan"))
        if hasattr(run, "batch"):  # the running batch applying the scheduler's update (not in older trees)
            self._patch(run.batch, "apply", timed("pack"))
        else:
            self._patch(eng, "_row_work", timed("pack"))
        self._patch(run, "prepare_inputs", timed("pack"))

        def run_step(fn):
            def wrapper(shape, inputs, *rest):
                self.last["shape"] = shape
                return fn(shape, inputs, *rest)

            return wrapper

        from jaxserve.runner.step_io import PendingSamples

        real_result = PendingSamples.result

        def result(pending):  # every PendingSamples: they are made per step
            t = pc()
            out = real_result(pending)
            self.last["result_end"] = pc()
            self._add("wait", self.last["result_end"] - t)
            return out

        PendingSamples.result = result
        self._restore.append(lambda: setattr(PendingSamples, "result", real_result))

        def put_inputs(fn):  # Layout.pack (timed as pack), then put_buffer (timed as copy)
            def wrapper(shape, inputs):
                t = pc()
                host = run.table.layouts[shape].pack(inputs)
                self._add("pack", pc() - t)
                return run.put_buffer(host)

            return wrapper

        def put_buffer(fn):
            def wrapper(host):
                t = pc()
                buffer = fn(host)
                self._add("copy", pc() - t)
                self.last["host_buffer"], self.last["buffer"] = host, buffer
                return buffer

            return wrapper

        # Every step reaches `_run` (engine steps and rows given whole); a tree from before it: `run_step`.
        self._patch(run, "_run" if hasattr(run, "_run") else "run_step", run_step)
        self._patch(run, "put_inputs", put_inputs)
        self._patch(run, "put_buffer", put_buffer)

        def finish_step(fn):
            def wrapper(*a, **k):
                t = pc()
                # from the samples on the host to here: unpacking them to rows, appending tokens,
                # detokenizing, stop checks
                self._add("postprocess", t - self.last.pop("result_end"))
                out = fn(*a, **k)
                self._add("emit", pc() - t)
                return out

            return wrapper

        self._patch(eng, "_finish_step", finish_step)

        self._executables = dict(run.table.executables)
        for shape, exe in self._executables.items():

            def recorder(*a, _exe=exe):
                t = pc()
                out = _exe(*a)
                self._add("dispatch", pc() - t)
                self.last["executable"] = _exe
                if isinstance(a[-1], np.ndarray):  # the packed inputs, copied by the call itself
                    self.last["host_buffer"] = self.last["buffer"] = a[-1]
                self.last["fetched_bytes"] = sum(x.nbytes for x in jax.tree.leaves(out[0]))
                return out

            run.table.executables[shape] = recorder
        return self

    def remove(self) -> None:
        for obj, name in reversed(self._patched):
            try:
                delattr(obj, name)  # back to the class's method
            except AttributeError:
                pass
        self._patched.clear()
        for undo in self._restore:
            undo()
        self._restore.clear()
        self.runner.table.executables.update(self._executables)

    def step(self) -> tuple[float, dict[str, float], list]:
        """One engine step as LLM.generate drives it; (seconds, phases, outputs)."""
        self.marks = {}
        t = time.perf_counter()
        outputs = self.steps.step()
        finished = [out for out in outputs if out.finished]  # what LLM._run does with them
        total = time.perf_counter() - t
        del finished
        return total, phase_split(self.marks, total), outputs


# ---- one point --------------------------------------------------------------------------------------
def measure_point(llm, batch: int, context: int, args, seed: int) -> dict:
    import jax

    from jaxserve import SamplingParams

    eng, runner, steps = llm.engine, llm.runner, llm.overlap
    span = decode_steps(args)
    # Prompt tails are prefilled a few rows per step, alternating with decode steps of the rows
    # already in: the first rows run ahead by up to one token per admission step (the skew).
    skew = admission_skew(batch, llm.config.max_num_batched_tokens, runner.buckets.chunk_sizes[0])
    n_prompt = prompt_length(context, span + skew)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(4, llm.model_config.vocab_size, n_prompt).tolist()
    t_setup, preempted_at_start = time.perf_counter(), eng.scheduler.num_preemptions
    # Seed the prefix cache: one request computes the prompt's pages, which stay cached when it ends.
    eng.add_request(f"seed-{seed}", None, SamplingParams(max_tokens=1, ignore_eos=True), prompt)
    while steps.has_unfinished_requests():
        steps.step()
    sp = SamplingParams(max_tokens=span + skew + 2, temperature=0.0, ignore_eos=True)
    ids = [f"p{seed}-{i}" for i in range(batch)]
    for rid in ids:
        eng.add_request(rid, None, sp, prompt)
    while any(not eng.requests[r].seqs[0].output_token_ids for r in ids):  # prefill tails: one token each
        steps.step()
    for _ in range(args.warmup_steps):  # compiles/first-runs the decode bucket if needed
        steps.step()
    entry_preemptions = eng.scheduler.num_preemptions - preempted_at_start
    setup_s = time.perf_counter() - t_setup

    seqs = [eng.requests[r].seqs[0] for r in ids]
    lo = min(q.num_tokens for q in seqs)
    timer = StepTimer(eng, steps).install()
    unplanned, first_runs = runner.unplanned_compiles, runner.first_runs
    preemptions = eng.scheduler.num_preemptions
    runs = {mode: {"step_s": [], "phases": [], "kinds": set(), "shapes": set(), "rounds": []} for mode in args.modes}
    round_device = []
    try:
        for _ in range(args.rounds):
            for mode in args.modes:  # one engine: flushed, then switched
                steps.flush()
                steps.async_scheduling = mode
                steps.step()  # untimed: with async scheduling, it puts a step in flight (the steady state)
                run = runs[mode]
                t = time.perf_counter()
                for _ in range(args.steps):
                    s, ph, outputs = timer.step()
                    run["step_s"].append(s)
                    run["phases"].append(ph)
                    plan = timer.last["plan"]
                    run["kinds"].add((plan.kind, len(plan.rows), len(outputs)))
                    run["shapes"].add(timer.last["shape"])
                run["rounds"].append(time.perf_counter() - t)
            steps.flush()  # nothing in flight: the calls below replace the carried samples
            # device-only: the same executable, the last step's (device-resident) inputs, back to back
            exe, buffer = timer.last["executable"], timer.last["buffer"]
            if isinstance(buffer, np.ndarray):  # device-resident, as the definition of device-only says
                buffer = jax.device_put(buffer, runner.buffer_sharding)
            out = None
            t = time.perf_counter()
            for _ in range(args.steps):
                out, runner.cache, runner.carried = exe(
                    runner.params, runner.cache, runner.carried, runner.last_sparse, buffer
                )
            jax.block_until_ready((out, runner.cache))
            round_device.append(time.perf_counter() - t)
    finally:
        timer.remove()
        steps.flush()
        steps.async_scheduling = llm.config.async_scheduling
        hi = max(q.num_tokens for q in seqs) - 1  # the last step attended all but the token it sampled
        for rid in ids:
            eng.abort_request(rid)
    entries = []
    for mode, run in runs.items():
        entry = {
            "batch": batch,
            "context": context,
            "async_scheduling": mode,
            "prompt_tokens": n_prompt,
            "preemptions_before_timing": entry_preemptions,
            "contexts_attended": [lo, hi],
            "setup_s": setup_s,
        }
        entry.update(summarize_point(batch, run["step_s"], run["rounds"], round_device, args.steps, run["phases"]))
        shapes = run["shapes"]
        entry["bucket"] = list(next(iter(shapes))) if len(shapes) == 1 else [list(s) for s in sorted(shapes)]
        entry["bytes_to_device_per_step"] = int(timer.last["host_buffer"].nbytes)
        entry["bytes_from_device_per_step"] = int(timer.last["fetched_bytes"])
        problems = []
        if run["kinds"] != {("decode", batch, batch)}:
            problems.append(f"steps were not all {batch}-row decodes: {sorted(run['kinds'])}")
        if len(shapes) != 1:
            problems.append(f"steps ran {len(shapes)} buckets: {sorted(shapes)}")
        if runner.unplanned_compiles != unplanned or runner.first_runs != first_runs:
            problems.append("a compile or a first run inside the timed steps")
        if eng.scheduler.num_preemptions != preemptions:
            problems.append(f"{eng.scheduler.num_preemptions - preemptions} preemptions inside the timed steps")
        entry["valid"], entry["problems"] = not problems, problems
        entries.append(entry)
    return entries


# ---- one model --------------------------------------------------------------------------------------
def build_llm(config: str | None, overrides: dict, batch: int, contexts: Sequence[int], span: int, args):
    """An engine for every point of one model: up to `batch` rows, contexts up to max(contexts) (plus a
    page), and pages for the shared prompt plus each row's own decode pages."""
    import logging

    from jaxserve import LLM
    from jaxserve.config import EngineConfig

    base = EngineConfig.from_yaml(config, overrides) if config else EngineConfig.from_dict(overrides)
    page = base.page_size
    ctx = max(contexts)
    own = math.ceil((span + 2) / page) + 3  # a row's pages past the shared prefix (tail, decode tokens), slack
    settings = base.to_dict()
    settings.update(
        max_num_seqs=batch,
        max_model_len=ctx + page,
        num_pages=math.ceil(ctx / page) + batch * own + 64,
        kv_cache_memory=None,
        enable_prefix_caching=True,
        speculative_model=None,
        num_speculative_tokens=0,
        num_scheduler_steps=1,
    )
    if args.no_compilation_cache:
        settings["compilation_cache_dir"] = "none"
    model = settings.pop("model")
    llm = LLM(model=model, warm_up=False, **settings)
    logging.getLogger("jaxserve.runner.executables").setLevel(logging.ERROR)  # prefill shapes compile on demand
    return llm


def bench_model(
    name: str, config: str | None, overrides: dict, batches: Sequence[int], contexts: Sequence[int], args
) -> dict:
    import jax

    from jaxserve.config import EngineConfig, ModelConfig
    from jaxserve.engine.buckets import pick_step_shape
    from jaxserve.model.weights import param_bytes

    span = decode_steps(args)
    base = EngineConfig.from_yaml(config, overrides) if config else EngineConfig.from_dict(overrides)
    cfg = ModelConfig.from_dir(base.model)
    limit = cfg.max_position_embeddings
    page = base.page_size
    skipped, points = [], []
    for c in contexts:
        for b in batches:
            why = None
            lowest = prompt_length(c, span + admission_skew(b, base.max_num_batched_tokens, 16)) + 1
            if c + page > limit:
                why = f"context {c} + a page exceeds the model's max_position_embeddings {limit}"
            elif lowest < 2:
                why = (
                    f"the {span} decode steps measured would start at {lowest} tokens, before the prompt's "
                    f"first: fewer --steps or --rounds"
                )
            elif f"{name}:{b}x{c}" in args.skip:
                why = "skipped (--skip): machine time"
            (skipped.append({"batch": b, "context": c, "reason": why}) if why else points.append((b, c)))
    report: dict[str, Any] = {"name": name, "config": config, "overrides": overrides, "points": [], "skipped": skipped}
    if not points:
        return report
    t = time.perf_counter()
    llm = build_llm(config, overrides, max(b for b, _ in points), [c for _, c in points], span, args)
    runner = llm.runner
    report.update(
        model=llm.config.model,
        dtype=jax.numpy.dtype(runner.params.embed.dtype).name,
        param_bytes=param_bytes(runner.params),
        tokenizer=llm.tokenizer is not None,
        page_size=llm.memory.page_size,
        buckets={"batch": list(runner.buckets.batch_sizes), "pages": list(runner.buckets.page_counts)},
    )
    # The decode buckets of every point, compiled up front in parallel (prefill shapes compile on demand).
    shapes = sorted({pick_step_shape(runner.buckets, b, math.ceil(c / page)) for b, c in points})
    runner.warm_up(shapes, progress=False)
    report["build_and_compile_s"] = time.perf_counter() - t
    print(
        f"{name}: engine built, {len(shapes)} decode buckets compiled in {report['build_and_compile_s']:.0f} s",
        flush=True,
    )
    for i, (b, c) in enumerate(points):
        load = os.getloadavg()[0]
        try:
            entries = measure_point(llm, b, c, args, seed=i)
        except Exception as err:  # noqa: BLE001 - one failed point must not lose the others
            entries = [{"batch": b, "context": c, "error": repr(err), "valid": False}]
            print(f"  batch {b:>3} context {c:>5}: failed: {err!r}", file=sys.stderr, flush=True)
        else:
            for entry in entries:
                print(
                    f"  batch {b:>3} context {c:>5} async {'on ' if entry['async_scheduling'] else 'off'}: engine "
                    f"{entry['engine_tokens_per_s']:9.1f} tok/s, device-only {entry['device_tokens_per_s']:9.1f}, "
                    f"ratio {entry['ratio']:.2f}" + ("" if entry["valid"] else f"  INVALID: {entry['problems']}"),
                    flush=True,
                )
        for entry in entries:
            entry["load_average_before"] = load
            report["points"].append(entry)
    llm.close()
    return report


# ---- report -----------------------------------------------------------------------------------------
def machine_info() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        cpu = next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), cpu)
    except (OSError, subprocess.SubprocessError):
        pass
    from bench_decode import git_state, tcmalloc_loaded

    commit, dirty = git_state(ROOT)
    tcmalloc = tcmalloc_loaded()
    import jax

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "tcmalloc_preloaded": tcmalloc,
        "commit": commit,
        "jaxserve_dirty": dirty,
    }


def print_report(report: dict) -> None:
    m = report["machine"]
    print(
        f"\n{report['date']}  commit {m['commit']}{' (dirty)' if m['jaxserve_dirty'] else ''}  {m['cpu']}, "
        f"{m['cores']} cores [{m['backend']}], jax {m['jax']}, load {report['load_average_start'][0]:.2f} -> "
        f"{report['load_average_end'][0]:.2f}"
    )
    print(
        f"{report['settings']['rounds']} rounds x {report['settings']['steps']} steps per point "
        f"(+{report['settings']['warmup_steps']} warm-up); host phases in us per step (mean)"
    )
    head = (
        f"{'model':>13} {'B':>3} {'ctx':>5} {'async':>5} {'engine':>9} {'device':>9} {'ratio':>5} {'step us':>9} "
        + " ".join(f"{p[:8]:>8}" for p in PHASES)
        + f" {'H2D B':>7}"
    )
    print(head + "\n" + "-" * len(head))
    for mod in report["models"]:
        for p in mod["points"]:
            if "error" in p:
                print(f"{mod['name']:>13} {p['batch']:>3} {p['context']:>5}  failed: {p['error']}")
                continue
            print(
                f"{mod['name']:>13} {p['batch']:>3} {p['context']:>5} {'on' if p['async_scheduling'] else 'off':>5} "
                f"{p['engine_tokens_per_s']:9.1f} "
                f"{p['device_tokens_per_s']:9.1f} {p['ratio']:5.2f} {p['step_us']:9.0f} "
                + " ".join(f"{p['phases_us'][ph]:8.0f}" for ph in PHASES)
                + f" {p['bytes_to_device_per_step']:7d}"
                + ("" if p["valid"] else "  INVALID")
            )
        for s in mod["skipped"]:
            print(f"{mod['name']:>13} {s['batch']:>3} {s['context']:>5}  not run: {s['reason']}")
    print("engine / device = decode tokens/s through LLMEngine.step / of the same executable called back to back")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="small,smollm2-135m", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="128,1024", help="tokens attended by the last measured step")
    ap.add_argument("--steps", type=int, default=16, help="engine steps (and device-only calls) per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating engine / device-only rounds per point")
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps before the first round")
    ap.add_argument("--async-scheduling", default="off,on", help="engine modes measured, alternating in each round")
    ap.add_argument("--skip", default="", help="points left out, e.g. smollm2-135m:64x1024,smollm2-135m:16x1024")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny 2-layer dummy model, batches 1,2, contexts 32,64, 2 rounds of 3 steps: seconds",
    )
    ap.add_argument("--no-compilation-cache", action="store_true", help="do not use the persistent XLA cache")
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    modes = {"on": True, "off": False}
    if not args.async_scheduling or any(m not in modes for m in args.async_scheduling.split(",")):
        ap.error("--async-scheduling takes a comma list of on, off")
    args.modes = [modes[m] for m in args.async_scheduling.split(",")]

    tmp = None
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]
    if args.quick:
        from roofline import write_tiny_model

        tmp = tempfile.TemporaryDirectory()
        models = [
            (
                "tiny",
                None,
                {
                    "model": write_tiny_model(tmp.name),
                    "load_format": "dummy",
                    "seed": 0,
                    "page_size": 16,
                    "max_num_batched_tokens": 64,
                },
            )
        ]
        for name, value in (("batches", "1,2"), ("contexts", "32,64")):
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, value)
        if args.steps == ap.get_default("steps"):
            args.steps = 3
        if args.rounds == ap.get_default("rounds"):
            args.rounds = 2
        args.warmup_steps = min(args.warmup_steps, 1)
    else:
        unknown = [m for m in args.models.split(",") if m not in MODELS]
        if unknown:
            ap.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
        models = [(m, *MODELS[m]) for m in args.models.split(",")]
    batches, contexts = sorted(set(ints(args.batches))), sorted(set(ints(args.contexts)))

    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    print(f"{date}: load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}", flush=True)
    results = [bench_model(name, config, overrides, batches, contexts, args) for name, config, overrides in models]
    report = {
        "date": date,
        "command": " ".join([os.path.relpath(sys.argv[0])] + list(argv if argv is not None else sys.argv[1:])),
        "machine": machine_info(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "settings": {
            "steps": args.steps,
            "rounds": args.rounds,
            "warmup_steps": args.warmup_steps,
            "async_scheduling": args.modes,
            "batches": batches,
            "contexts": contexts,
            "skip": sorted(args.skip),
        },
        "phases": list(PHASES),
        "models": results,
        "elapsed_s": time.perf_counter() - t0,
    }
    print_report(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.out}")
    print(f"elapsed {report['elapsed_s']:.0f} s")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
