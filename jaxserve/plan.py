"""`python -m jaxserve.plan`: will a model fit on these devices, how many sequences, and how fast at best?

From a settings YAML (or flags) and one entry of the device table (`jaxserve.planning.devices`) it prints:
parameter bytes per device, KV bytes per token, the tokens and concurrent sequences that fit, lower
bounds on the decode step and on prefill, and the cost per million output tokens at that bound. A
plan that does not fit is refused (exit status 2) with the shortfall in bytes.

    python -m jaxserve.plan --config configs/llama3-70b-tp8-int8.yaml --device h100
    python -m jaxserve.plan --model configs/models/llama3-8b --device tpu-v5e --devices 4 --context 8192
    python -m jaxserve.plan --config configs/smollm2-135m-dummy.yaml --device cpu --measure-bandwidth
    python -m jaxserve.plan capacity out/bench.json --target-rate 20 --device h100   # replicas for a rate

`capacity` reads a scripts/bench_serving.py result (one replica measured at several request rates,
with --slo-ttft/--slo-tpot) and sizes the replicas for a target rate; `capacity --help`.

Every bound is a *lower* bound on time (an upper bound on throughput): the step reads each weight
and each sequence's KV once at peak bandwidth, multiplies at peak FLOP/s, and all-reduces at peak
interconnect bandwidth with no latency. Real steps are slower; the gap is what to optimise.

This module is the command line only: the memory and roofline model is `jaxserve.planning.roofline`
(small pure functions scripts reuse, the byte counts taken from `ModelConfig` and `sharding.logical_rules`
so the plan cannot drift from what the engine allocates), its application to settings and the mesh
choice `jaxserve.planning.mesh`, capacity from benchmark results `jaxserve.planning.capacity`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence

from jaxserve.loading import resources
from jaxserve.config import EngineConfig
from jaxserve.planning.devices import DEVICES, DeviceSpec, cpu_spec, get_device, spec_for_device_kind
from jaxserve.errors import ConfigError, JaxServeError
from jaxserve.planning.capacity import capacity_plan, replica_capacity
from jaxserve.planning.memory import RESERVED_PAGES, host_tier_line
from jaxserve.planning.mesh import plan_from_settings, suggest_mesh
from jaxserve.planning.roofline import Plan, Target, fmt_bytes
from jaxserve.config.settings import parse_size

DEFAULT_DEVICE = "h100"
EXIT_DOES_NOT_FIT = 2


# ---- capacity -------------------------------------------------------------------------------------------


def local_device() -> tuple[DeviceSpec | None, int, str]:
    """(spec, number of devices, device kind) of the accelerator jax sees here; spec None if not in the table."""
    import jax

    devices = jax.devices()
    kind = devices[0].device_kind
    spec = spec_for_device_kind("cpu" if devices[0].platform == "cpu" else kind)
    return spec, len(devices), kind


def build_capacity_parser(prog: str = "python -m jaxserve.plan capacity") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Replicas (and devices) needed to serve --target-rate requests/s within a latency SLO, from "
        "one replica's goodput measured by scripts/bench_serving.py (its --result-json).",
    )
    p.add_argument("bench_json", help="scripts/bench_serving.py --result-json output, runs at several rates")
    p.add_argument("--target-rate", type=float, required=True, help="requests/s to serve")
    p.add_argument("--label", default=None, help="which server of the JSON (default: the first)")
    p.add_argument(
        "--slo-ttft",
        type=float,
        default=None,
        help="TTFT SLO, ms (needs --save-requests records; default: the goodput the JSON holds)",
    )
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO, ms (as --slo-ttft)")
    p.add_argument(
        "--min-attainment",
        type=float,
        default=0.9,
        help="share of requests that must meet the SLO at a rate for it to count",
    )
    p.add_argument("--headroom", type=float, default=0.0, help="spare capacity to keep, e.g. 0.2 for 20%%")
    p.add_argument(
        "--devices-per-replica",
        type=int,
        default=None,
        help="devices one measured server used (default: the JSON's --num-devices, else 1)",
    )
    p.add_argument("--device", default=None, help="price devices at this table entry's $/hour")
    p.add_argument(
        "--cost-per-hour",
        type=float,
        default=None,
        help="USD per device-hour (default: --device's, else the JSON's --cost-per-hour)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def capacity_main(argv: Sequence[str], prog: str = "python -m jaxserve.plan capacity") -> int:
    args = build_capacity_parser(prog).parse_args(list(argv))
    try:
        with open(args.bench_json, encoding="utf-8") as f:
            report = json.load(f)
        runs_by_label = report.get("runs") or {}
        if not runs_by_label:
            raise ConfigError(f"{args.bench_json} has no runs")
        label = args.label or next(iter(runs_by_label))
        if label not in runs_by_label:
            raise ConfigError(f"no server labelled {label!r} in {args.bench_json}; labels: {', '.join(runs_by_label)}")
        bench_config = report.get("config") or {}
        replica = replica_capacity(runs_by_label[label], args.min_attainment, args.slo_ttft, args.slo_tpot)
        cost = args.cost_per_hour
        if cost is None and args.device:
            cost = get_device(args.device).cost_per_hour
        if cost is None:
            cost = bench_config.get("cost_per_hour")
        per_replica = args.devices_per_replica or bench_config.get("num_devices") or 1
        result = capacity_plan(
            args.target_rate,
            replica.requests_per_s,
            per_replica,
            cost,
            args.headroom,
            replica.mean_input_tokens,
            replica.mean_output_tokens,
        )
    except (JaxServeError, ValueError, OSError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"replica": dataclasses.asdict(replica), "plan": dataclasses.asdict(result)}, indent=2))
        return 0
    slo = (
        f"TTFT <= {args.slo_ttft} ms, TPOT <= {args.slo_tpot} ms"
        if args.slo_ttft or args.slo_tpot
        else f"TTFT <= {bench_config.get('slo_ttft')} ms, TPOT <= {bench_config.get('slo_tpot')} ms"
    )
    print(
        f"one replica ({label}, {per_replica} device(s)): {replica.requests_per_s:.3f} requests/s within the SLO "
        f"({slo}; {100 * replica.attainment:.1f}% of requests at offered rate {replica.offered_rate}; "
        f"p99 TPOT {replica.p99_tpot_ms:.1f} ms, p99 TTFT {replica.p99_ttft_ms:.0f} ms)"
    )
    if replica.saturated:
        print(
            f"warning: that run served fewer requests/s than offered ({replica.offered_rate}): the replica was "
            "saturated and a longer run would queue more and break the TTFT SLO; the capacity is optimistic, "
            "measure a rate just below it with more prompts",
            file=sys.stderr,
        )
    if not replica.meets_attainment:
        print(
            f"warning: no measured rate kept {100 * args.min_attainment:.0f}% of requests within the SLO; "
            "this is the best goodput seen, not a safe capacity: measure lower rates",
            file=sys.stderr,
        )
    print(
        f"target {result.target_rate:g} requests/s (+{100 * result.headroom:.0f}% headroom): "
        f"{result.replicas} replica(s) = {result.devices} device(s), at {100 * result.utilisation:.0f}% of "
        "their measured capacity"
    )
    if result.cost_per_hour is not None:
        print(
            f"cost ${result.cost_per_hour:.2f}/hour: ${result.usd_per_million_input_tokens:.4f} per million input "
            f"tokens or ${result.usd_per_million_output_tokens:.4f} per million output tokens (each charged the "
            f"whole cost; {replica.mean_input_tokens:.0f} in / {replica.mean_output_tokens:.0f} out per request)"
        )
    return 0


# ---- output -------------------------------------------------------------------------------------------
def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.2f} s"


def fmt_rate(x: float) -> str:
    return f"{x / 1e12:.4g} T" if x >= 1e12 else f"{x / 1e9:.4g} G"


def describe(plan: Plan) -> str:
    t, cfg = plan.target, plan.cfg
    data, model = t.mesh_shape
    weights = (
        "int8 linear layers" + (" and lm_head" if plan.quantize_lm_head else "") + f", the rest {plan.dtype}"
        if plan.quantization == "int8"
        else plan.dtype
    )
    kv_dtype = {
        "int8": "int8 (+ f32 scales)",
        "fp8": "float8 e4m3 (+ f32 scales per layer)",
        "fp8_e4m3": "float8 e4m3 (+ f32 scales per layer)",
        "fp8_e5m2": "float8 e5m2 (+ f32 scales per layer)",
    }.get(plan.kv_cache_dtype, plan.dtype)
    overrides = f" (overridden: {', '.join(t.overridden)})" if t.overridden else ""
    active = ""
    if cfg.is_moe:
        active = (
            f" ({cfg.active_params() / 1e9:.2f} B active per token: {cfg.num_experts_per_tok} of "
            f"{cfg.num_experts} experts in each of {cfg.num_moe_layers} MoE layers)"
        )
        split = (
            f"expert-parallel, {cfg.num_experts // model} whole experts per device"
            if plan.expert_parallel
            else "tensor-parallel, each expert split over the model axis"
            if model > 1
            else "all on each device"
        )
        weights += f"; experts {split}"
    lines = [
        f"model      {plan.model}: {cfg.num_params() / 1e9:.2f} B parameters{active}, {cfg.num_layers} layers, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of {cfg.head_dim}",
        f"           weights {weights}; KV cache {kv_dtype}; page_size {plan.page_size}",
        f"target     {t.num_devices} x {t.spec.description} [{t.spec.name}], "
        f"mesh (data {data}, model {model}){overrides}",
        f"           per device: {fmt_bytes(t.memory_bytes)}, {fmt_rate(t.bandwidth)}B/s, "
        f"{fmt_rate(t.peak_flops)}FLOP/s, all-reduce {fmt_rate(t.allreduce_bandwidth)}B/s, "
        f"${t.cost_per_hour:.2f}/hour",
        "",
        "memory per device",
        f"  parameters          {fmt_bytes(plan.param_bytes_per_device):>12}   "
        f"({fmt_bytes(plan.param_bytes_total)} in all)",
        f"  usable              {fmt_bytes(plan.usable_bytes_per_device):>12}   "
        f"({fmt_bytes(t.memory_bytes)} x --gpu-memory-utilization {plan.memory_fraction:g})",
        f"  left for KV cache   {fmt_bytes(plan.kv_budget_per_device):>12}",
        f"  KV per token        {fmt_bytes(plan.kv_bytes_per_token_per_device):>12}   "
        f"({fmt_bytes(plan.kv_bytes_per_token)} per token for the whole model, "
        f"split over {plan.kv_split} device(s))",
        f"  tokens that fit     {plan.tokens_per_replica:>12,}   per replica ({plan.pages_per_replica:,} pages), "
        f"{plan.tokens_per_replica * data:,} on the mesh",
        f"  {f'sequences of {plan.context}':<19} {plan.max_batch:>12,}   per replica, "
        f"{plan.max_batch * data:,} on the mesh",
    ]
    if plan.engine_pages is not None:
        lines.append(
            f"  engine allocates    {plan.engine_pages:>12,}   pages per replica (num_pages / kv_cache_memory)"
        )
    elif plan.pages_per_replica > 0:
        lines.append(
            f"  to use it all       num_pages: {plan.pages_per_replica + RESERVED_PAGES}   "
            "(on a GPU or TPU the engine sizes its cache from --gpu-memory-utilization itself, less an "
            "activation reserve; on a CPU it takes a fixed 2 GiB unless num_pages is set)"
        )
    if plan.decode:
        lines += [
            "",
            f"lower bounds (roofline: peak bandwidth and FLOP/s, no overheads; real steps are slower)",
            f"  decode step, every sequence at {plan.context} tokens of context; cost at ${t.cost_per_hour:.2f}"
            f" x {t.num_devices} devices per hour:",
            f"  {'batch/replica':>13} {'memory':>11} {'compute':>11} {'all-reduce':>11} {'step ≥':>11} "
            f"{'tokens/s ≤':>11} {'$/M tokens ≥':>13}"
            + (f" {'experts/layer':>13} {'weights read':>12}" if cfg.is_moe else ""),
        ]
        for d in plan.decode:
            moe = f" {d.experts_read:>13.1f} {fmt_bytes(d.weight_bytes):>12}" if cfg.is_moe else ""
            lines.append(
                f"  {d.batch:>13,} {fmt_seconds(d.memory_s):>11} {fmt_seconds(d.compute_s):>11} "
                f"{fmt_seconds(d.allreduce_s):>11} {fmt_seconds(d.seconds):>11} {d.tokens_per_s:>11,.0f} "
                f"{d.usd_per_million_tokens:>13.4f}{moe}"
            )
        p = plan.prefill
        lines.append(
            f"  prefill of one {p.tokens}-token prompt: ≥ {fmt_seconds(p.seconds)} (compute "
            f"{fmt_seconds(p.compute_s)}, memory {fmt_seconds(p.memory_s)}, all-reduce "
            f"{fmt_seconds(p.allreduce_s)}): time to first token ≥ that"
        )
        lines.append(
            f"  cost at the bounds: ≥ ${p.usd_per_million_tokens:.4f} per million input (prompt) tokens "
            f"(prefill, {p.tokens_per_s:,.0f} tokens/s ≤), ≥ ${plan.usd_per_million_output_tokens:.4f} per "
            f"million output tokens (decode at batch {plan.batch}/replica)"
        )
        if model > 1:
            lines.append(f"  all-reduce: 2 x {cfg.num_layers} per step (+ a few µs of latency each, not counted)")
    for note in plan.notes:
        lines.append(f"note: {note}")
    if plan.problems:
        lines += ["", "DOES NOT FIT:"] + [f"  - {p}" for p in plan.problems]
        lines.append(
            "  try: more devices on the model axis, quantization: int8, kv_cache_dtype: int8 or fp8, "
            "a shorter context or a smaller batch"
        )
        if plan.kv_budget_per_device <= 0:
            least = -(-plan.param_bytes_total // plan.usable_bytes_per_device)
            lines.append(
                f"  the parameters alone need at least {least} such devices on the model axis: "
                f"--devices N --suggest-mesh (N >= {least}) picks a mesh"
            )
    else:
        lines += ["", "fits."]
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------------------
def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _rate(text: str) -> float:
    """A bandwidth or FLOP/s: 3.35e12, or a size per second such as 50GB."""
    try:
        return float(text)
    except ValueError:
        return float(_size(text))


def build_parser(prog: str = "python -m jaxserve.plan") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=None, help="YAML file of engine settings; flags override it")
    g = parser.add_argument_group("target")
    g.add_argument(
        "--device",
        default=None,
        help=f"device from the table ({', '.join(DEVICES)}) or 'auto' (the one jax sees here); "
        f"default: {DEFAULT_DEVICE}",
    )
    g.add_argument(
        "--devices",
        type=int,
        default=None,
        help="number of devices; default: data x model of mesh_shape (a 1,1 mesh becomes 1,N)",
    )
    g.add_argument("--device-memory", type=_size, default=None, help="memory per device, e.g. 80GiB (override)")
    g.add_argument(
        "--bandwidth",
        type=_rate,
        default=None,
        help="memory bandwidth per device in bytes/s, e.g. 3.35e12 or 50GB (override; for 'cpu' the "
        "whole host's, else measured)",
    )
    g.add_argument("--peak-flops", type=_rate, default=None, help="peak FLOP/s per device (override)")
    g.add_argument("--cost-per-hour", type=float, default=None, help="USD per device-hour (override)")
    g.add_argument(
        "--measure-bandwidth",
        action="store_true",
        help="measure this host's copy bandwidth and matmul FLOP/s now and print them (for --device cpu)",
    )
    g.add_argument("--list-devices", action="store_true", help="print the device table and exit")
    g.add_argument(
        "--suggest-mesh",
        action="store_true",
        help="print only the mesh_shape to use on --devices devices (all local ones with --device auto), "
        "e.g. 8,1: the smallest model axis that fits, the rest data-parallel; for a mixture of "
        "experts also expert- or tensor-parallel experts, with the reason (on stderr)",
    )
    g.add_argument(
        "--expert-parallel",
        action="store_true",
        help="mixture of experts: split whole experts over the model axis (default: split each expert)",
    )
    w = parser.add_argument_group("workload")
    w.add_argument("--context", type=int, default=None, help="tokens per sequence; default: max_model_len")
    w.add_argument(
        "--batch",
        type=int,
        default=None,
        help="decode batch per replica to plan for (refused if it does not fit); default: max_num_seqs",
    )
    w.add_argument("--prompt-len", type=int, default=None, help="prompt length of the prefill bound; default: context")
    w.add_argument("--memory-fraction", dest="memory_fraction", default=None, help=argparse.SUPPRESS)  # refused
    w.add_argument("--json", action="store_true", help="print the plan as JSON")
    EngineConfig.add_cli_arguments(parser)
    return parser


def list_devices() -> str:
    rows = [
        f"{'name':<9} {'memory':>10} {'HBM B/s':>9} {'bf16 FLOP/s':>12} {'all-reduce B/s':>15} "
        f"{'$/hour':>7}  description"
    ]
    for s in DEVICES.values():
        if s.name == "cpu":
            rows.append(
                f"{'cpu':<9} {'host RAM':>10} {'measured':>9} {'measured':>12} {'bw / 2':>15} "
                f"{s.cost_per_hour:>7.2f}  {s.description}"
            )
            continue
        rows.append(
            f"{s.name:<9} {fmt_bytes(s.memory_bytes):>10} {fmt_rate(s.hbm_bandwidth):>9} "
            f"{fmt_rate(s.peak_flops):>12} {fmt_rate(s.allreduce_bandwidth):>15} {s.cost_per_hour:>7.2f}  "
            f"{s.description}"
        )
    return "\n".join(rows)


def resolve_mesh(settings_mesh: tuple[int, ...], devices: int | None) -> tuple[int, int]:
    data, model = settings_mesh
    if devices is None or devices == data * model:
        return data, model
    if (data, model) == (1, 1):
        return 1, devices
    raise ConfigError(f"--devices {devices} disagrees with mesh_shape {data},{model} ({data * model} devices)")


def resolve_spec(name: str | None, settings: EngineConfig, args: argparse.Namespace) -> tuple[DeviceSpec, int | None]:
    """The device spec, and with --device auto the number of local devices."""
    name = name or getattr(settings, "device", None) or DEFAULT_DEVICE
    local_count = None
    if name == "auto":
        spec, local_count, kind = local_device()
        if spec is None:
            if not (args.device_memory and args.bandwidth and args.peak_flops):
                raise ConfigError(
                    f"the local device {kind!r} is not in the device table; pass --device NAME, or "
                    "--device-memory, --bandwidth and --peak-flops"
                )
            spec = DeviceSpec(kind.lower(), kind, 0, 0.0, 0.0, 0.0, 0.0)
            return spec, local_count
        name = spec.name
    spec = get_device(name)
    if spec.name == "cpu":
        spec = cpu_spec(args.bandwidth, args.peak_flops)
    return spec, local_count


def main(argv: Sequence[str] | None = None, prog: str = "python -m jaxserve.plan") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["capacity"]:
        return capacity_main(argv[1:], prog=f"{prog} capacity")
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.list_devices:
        print(list_devices())
        return 0
    try:
        if args.measure_bandwidth:
            from jaxserve.planning.devices import measure_copy_bandwidth, measure_matmul_flops

            bw, flops = measure_copy_bandwidth(), measure_matmul_flops()
            print(f"this host: numpy copy {bw / 1e9:.1f} GB/s (read + write), f32 matmul {flops / 1e9:.0f} GFLOP/s")
            args.bandwidth = args.bandwidth or bw
            args.peak_flops = args.peak_flops or flops
        if args.memory_fraction is not None:
            raise ConfigError(
                "--memory-fraction is now --gpu-memory-utilization, the flag (and YAML key) jaxserve "
                "serve sizes its memory by: the share of each device for parameters + KV cache"
            )
        settings = EngineConfig.from_namespace(args, resources.resolve_config(args.config) if args.config else None)
        memory_fraction = settings.gpu_memory_utilization
        settings = settings.replace(model=resources.resolve_shipped_path(settings.model))
        spec, local_count = resolve_spec(args.device, settings, args)
        if args.suggest_mesh:
            n = args.devices or local_count or settings.mesh_shape[0] * settings.mesh_shape[1]
            found = suggest_mesh(
                settings,
                spec,
                n,
                context=args.context,
                memory_fraction=memory_fraction,
                device_memory=args.device_memory,
                bandwidth=args.bandwidth,
                peak_flops=args.peak_flops,
            )
            if found is None:
                print(f"error: no mesh of {n} x {spec.name} fits this model at this context", file=sys.stderr)
                return EXIT_DOES_NOT_FIT
            (data, model), plan = found
            print(f"{data},{model}")
            print(
                f"mesh ({data}, {model}) on {n} x {spec.name}: {fmt_bytes(plan.param_bytes_per_device)} of "
                f"parameters per device, {plan.max_batch * data} sequences of {plan.context} tokens fit",
                file=sys.stderr,
            )
            if plan.mesh_reason:
                print(plan.mesh_reason, file=sys.stderr)
            return 0
        mesh = resolve_mesh(settings.mesh_shape, args.devices)
        target = Target.build(spec, mesh, args.device_memory, args.bandwidth, args.peak_flops, args.cost_per_hour)
        plan = plan_from_settings(
            settings,
            target,
            context=args.context,
            batch=args.batch,
            memory_fraction=memory_fraction,
            prompt_len=args.prompt_len,
            expert_parallel=args.expert_parallel,
        )
    except (JaxServeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    host = int(settings.kv_offloading_size * 2**30) if settings.kv_offloading_size else 0
    page_bytes = plan.kv_bytes_per_token * plan.page_size
    if args.json:
        out = plan.to_dict()
        if host:  # the prefix cache's host tier: host memory, beside the devices' plan
            out.update(host_tier_bytes=host, host_tier_pages=host // page_bytes)
        print(json.dumps(out, indent=2, default=str))
    else:
        print(describe(plan))
        if host:
            pages = plan.engine_pages - RESERVED_PAGES if plan.engine_pages else plan.pages_per_replica
            print("\nhost memory\n  " + host_tier_line(host, page_bytes, pages))
    if not plan.fits:
        print(f"error: the plan does not fit: {'; '.join(plan.problems)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
