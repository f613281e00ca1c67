"""Mesh sweep: the same settings and offline workload on each (data, model) mesh.

For each mesh of the sweep file it builds the engine, compiles every bucket (timed), runs the workload
of scripts/bench_throughput.py through `LLM.generate` (greedy, EOS ignored) and records output tokens/s,
TTFT and TPOT medians, the KV pages each device holds, compile seconds, and whether the greedy tokens
equal those of the first mesh. A mesh the engine refuses (e.g. a model axis that does not divide the
query heads) becomes a row saying why. Prints a Markdown table, writes CSV, JSON and a PNG.

    python scripts/sweep_mesh.py --config configs/sweeps/mesh.yaml --cpu-devices 4 --out out/sweep_mesh

--cpu-devices N gives N virtual CPU devices (set before jax is imported). They share the host's cores
and memory bandwidth, so such a sweep shows correctness and per-mesh overheads, not speed-up.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxserve.config import EngineConfig  # noqa: E402  (no jax import: safe before XLA_FLAGS)
from jaxserve.errors import ConfigError  # noqa: E402
from jaxserve.config.settings import (  # noqa: E402
    Settings,
    choice,
    optional,
    parse_int,
    parse_int_tuple,
    parse_size,
    parse_str,
    setting,
)


@dataclasses.dataclass(frozen=True)
class Workload(Settings):
    """The arguments of bench_throughput.workload(), as a validated settings object (same names)."""

    name: str = setting("workload", "label in the table", parse_str)
    num_requests: int = setting(16, "requests, all submitted at once", parse_int)
    mode: str = setting(
        "mixed", "fixed (input_len/output_len) or mixed (uniform in the min/max ranges)", choice("fixed", "mixed")
    )
    input_len: int = setting(32, "prompt tokens (mode fixed)", parse_int)
    output_len: int = setting(16, "new tokens (mode fixed)", parse_int)
    min_input: int = setting(16, "shortest prompt (mode mixed)", parse_int)
    max_input: int = setting(64, "longest prompt (mode mixed)", parse_int)
    min_output: int = setting(8, "fewest new tokens (mode mixed)", parse_int)
    max_output: int = setting(32, "most new tokens (mode mixed)", parse_int)
    vocab_limit: int = setting(1000, "prompt token ids are drawn below this", parse_int)
    workload_seed: int = setting(0, "seed of the lengths and prompts", parse_int)

    def validate(self) -> None:
        if self.num_requests < 1 or min(self.input_len, self.output_len, self.min_input, self.min_output) < 1:
            raise ConfigError("num_requests and every length must be at least 1")
        if self.min_input > self.max_input or self.min_output > self.max_output:
            raise ConfigError("min_input/min_output must not exceed max_input/max_output")


@dataclasses.dataclass(frozen=True)
class Sweep:
    base: EngineConfig
    meshes: tuple[tuple[int, int], ...]
    workloads: tuple[Workload, ...]
    kv_cache_memory_per_device: int | None = None


SWEEP_KEYS = ("base", "meshes", "workloads", "kv_cache_memory_per_device")


def load_sweep(path: str) -> Sweep:
    """Read and validate a sweep file; errors name the file and the offending key or value."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"sweep file {path!r} does not exist") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a sweep file is a mapping with keys {', '.join(SWEEP_KEYS)}")
    unknown = sorted(set(raw) - set(SWEEP_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(SWEEP_KEYS)}")
    try:
        base = EngineConfig.from_dict(raw.get("base") or {})
        meshes = tuple(parse_int_tuple(m) for m in raw.get("meshes") or [base.mesh_shape])
        for mesh in meshes:
            if len(mesh) != 2 or min(mesh) < 1:
                raise ConfigError(f"a mesh is two positive sizes [data, model], got {list(mesh)}")
        workloads = tuple(Workload.from_dict(w) for w in raw.get("workloads") or [{}])
        budget = optional(parse_size)(raw.get("kv_cache_memory_per_device"))
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    if budget is not None and (base.num_pages is not None or base.kv_cache_memory is not None):
        raise ConfigError(f"{path}: set kv_cache_memory_per_device or base num_pages/kv_cache_memory, not both")
    return Sweep(base, meshes, workloads, budget)


def use_cpu_devices(n: int) -> None:
    """N virtual CPU devices: must run before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("--cpu-devices must be applied before jax is imported")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


def percentile_50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_one(sweep: Sweep, mesh: tuple[int, int], load: Workload, reference: dict | None) -> dict[str, Any]:
    """Build the engine on `mesh`, compile, run the workload; one row of the table."""
    import jax

    from bench_throughput import workload
    from jaxserve.config import ModelConfig
    from jaxserve.llm import LLM
    from jaxserve.planning.weight_bytes import kv_split
    from jaxserve.sampling.params import SamplingParams

    data, model = mesh
    row: dict[str, Any] = dict(workload=load.name, mesh=f"{data}x{model}", data=data, model=model, devices=data * model)
    if data * model > len(jax.devices()):
        return dict(row, status=f"skipped: needs {data * model} devices, {len(jax.devices())} available")
    settings = sweep.base.replace(mesh_shape=mesh)
    try:
        if sweep.kv_cache_memory_per_device is not None:
            cfg = ModelConfig.from_dir(settings.model)
            settings = settings.replace(kv_cache_memory=sweep.kv_cache_memory_per_device * kv_split(cfg, model))
        start = time.perf_counter()
        llm = LLM(warm_up=False, **settings.to_dict())
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        llm.engine.warm_up()
        compile_s = time.perf_counter() - start
    except ConfigError as err:
        return dict(row, status=f"refused: {err}")
    except Exception as err:  # noqa: BLE001 - a failing mesh is a result of the sweep, reported in full
        traceback.print_exc()
        return dict(row, status=f"failed: {type(err).__name__}: {err}")

    prompts, out_lens = workload(load)
    params = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in out_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ttft, tpot = [], []
    for out in outputs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        ttft.append(m.first_token_time - m.arrival_time)
        if n > 1:
            tpot.append((m.finished_time - m.first_token_time) / (n - 1))
    tokens = [out.outputs[0].token_ids for out in outputs]
    stats = llm.engine.stats()
    plan = llm.memory
    row.update(
        status="ok",
        replicas=llm.engine.num_replicas,
        output_tokens=sum(out_lens),
        seconds=seconds,
        output_tokens_per_s=sum(out_lens) / seconds,
        ttft_p50_ms=1e3 * percentile_50(ttft),
        tpot_p50_ms=1e3 * percentile_50(tpot) if tpot else None,
        kv_pages_per_device=plan.num_pages,
        kv_bytes_per_device=plan.kv_cache_bytes // kv_split(llm.model_config, model),
        kv_tokens_mesh=llm.engine.num_replicas * plan.tokens_that_fit,
        compile_s=compile_s,
        load_s=load_s,
        buckets=len(llm.runner.step_shapes()),
        preemptions=stats["num_preemptions"],
        compiles_after_warmup=stats["compiles_after_warmup"],
        load_average_1min=os.getloadavg()[0],  # other work on the host slows every figure above
        tokens=tokens,
    )
    if reference is not None and reference.get("tokens") is not None:
        row["same_tokens_as_first"] = sum(a == b for a, b in zip(tokens, reference["tokens"]))
    del llm, outputs
    gc.collect()
    jax.clear_caches()
    return row


COLUMNS = [  # (key, header, format)
    ("mesh", "mesh (data x model)", "{}"),
    ("devices", "devices", "{}"),
    ("output_tokens_per_s", "output tok/s", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
    ("kv_pages_per_device", "KV pages/device", "{}"),
    ("kv_tokens_mesh", "KV tokens (mesh)", "{}"),
    ("compile_s", "compile s", "{:.1f}"),
    ("same_tokens_as_first", "greedy = first mesh", "{}"),
]


def markdown_table(rows: list[dict]) -> str:
    multi = len({r["workload"] for r in rows}) > 1
    cols = ([("workload", "workload", "{}")] if multi else []) + COLUMNS
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if r["status"] != "ok":
            cells = [fmt.format(r[k]) if k in ("workload", "mesh", "devices") else "" for k, _, fmt in cols]
            cells[-1] = r["status"]
        else:
            cells = []
            for k, _, fmt in cols:
                v = r.get(k)
                if k == "same_tokens_as_first":
                    v = "(reference)" if v is None else f"{v}/{len(r['tokens'])}"
                cells.append("–" if v is None else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: str) -> None:
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "tokens"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in keys})


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    labels = [r["mesh"] + ("" if len({x["workload"] for x in rows}) == 1 else f"\n{r['workload']}") for r in ok]
    panels = [
        ("output_tokens_per_s", "output tokens/s"),
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("tpot_p50_ms", "TPOT p50 (ms)"),
        ("compile_s", "compile (s)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (key, name) in zip(axes, panels):
        ax.bar(labels, [r.get(key) or 0 for r in ok], color="#4c72b0")
        ax.set_title(name)
        ax.set_xlabel("mesh (data x model)")
        ax.tick_params(axis="x", labelrotation=0)
    refused = [r["mesh"] for r in rows if r["status"] != "ok"]
    fig.suptitle(title + (f"   (not run: {', '.join(refused)})" if refused else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict[str, Any]:
    import jax

    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        host_cpus=os.cpu_count(),
        devices=[f"{d.platform}:{d.id}" for d in jax.devices()],
        device_kind=jax.devices()[0].device_kind,
        jax=jax.__version__,
        python=platform.python_version(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        load_average=os.getloadavg(),
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/sweeps/mesh.yaml", help="sweep file")
    parser.add_argument("--cpu-devices", type=int, default=None, help="run on N virtual CPU devices")
    parser.add_argument("--out", default="out/sweep_mesh", help="prefix of the .csv, .json and .png written")
    parser.add_argument("--meshes", default=None, help="only these meshes, e.g. 1x1,2x1 (default: the file's)")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args(argv)
    sweep = load_sweep(args.config)  # validate before spending minutes on anything
    if args.meshes:
        sweep = dataclasses.replace(sweep, meshes=tuple(parse_int_tuple(m) for m in args.meshes.split(",")))
    if args.cpu_devices:
        use_cpu_devices(args.cpu_devices)
    import logging

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_throughput's workload()

    info = machine()
    print(
        f"# mesh sweep {args.config}: {len(info['devices'])} {info['devices'][0].split(':')[0]} devices, "
        f"{info['host_cpus']} host CPUs, {info['date']}",
        flush=True,
    )
    rows = []
    for load in sweep.workloads:
        reference = None
        for mesh in sweep.meshes:
            print(f"-- {load.name} on mesh {mesh[0]}x{mesh[1]}", flush=True)
            row = run_one(sweep, mesh, load, reference)
            if reference is None and row["status"] == "ok":
                reference = row
            rows.append(row)
            shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "tokens"}
            print(f"   {shown}", flush=True)
    print()
    print(markdown_table(rows))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_csv(rows, args.out + ".csv")
    with open(args.out + ".json", "w") as f:
        json.dump(
            dict(
                machine=info,
                config=args.config,
                sweep=dict(
                    base=sweep.base.to_dict(),
                    kv_cache_memory_per_device=sweep.kv_cache_memory_per_device,
                    workloads=[w.to_dict() for w in sweep.workloads],
                ),
                rows=[{k: v for k, v in r.items() if k != "tokens"} for r in rows],
            ),
            f,
            indent=2,
        )
    plot(rows, args.out + ".png", f"{sweep.base.model} on {len(info['devices'])} {info['device_kind']} devices")
    print(f"\nwrote {args.out}.csv, {args.out}.json, {args.out}.png")
    return rows


if __name__ == "__main__":
    main()
