"""`python -m jaxserve.plan`: will a model fit on these devices, how many sequences, and how fast at best?

From a settings YAML (or flags) and one entry of the device table (`jaxserve.devices`) it prints:
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

The arithmetic is a set of small pure functions (`*_seconds`, `*_flops`, `cost_per_million_tokens`)
that scripts can reuse; the byte counts come from `ModelConfig.param_bytes` / `kv_bytes_per_token`,
and which arrays are split over the `model` axis from `sharding.logical_rules`, so the plan cannot
drift from what the engine allocates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any, Sequence

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.devices import DEVICES, DeviceSpec, cpu_spec, get_device, local_device
from jaxserve.errors import ConfigError, JaxServeError
from jaxserve.settings import parse_size

GiB, MiB, KiB = 2**30, 2**20, 2**10
RESERVED_PAGES = 1  # page 0 of each replica is the padding page (memory_plan.RESERVED_PAGES)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The weights int8 quantization replaces (ModelConfig.linear_params); lm_head only with quantize_lm_head.
LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
DEFAULT_DEVICE = "h100"
EXIT_DOES_NOT_FIT = 2


# ---- the roofline arithmetic: pure functions of numbers ------------------------------------------
def matmul_flops(params: float, tokens: float) -> float:
    """2 · P · T: one multiply-add per weight per token (P = weights that multiply activations)."""
    return 2.0 * params * tokens


def attention_flops(num_heads: int, head_dim: int, num_layers: int, query_tokens: float,
                    keys_per_query: float) -> float:
    """4 · N · H · L · T · S: q·k and p·v, 2 FLOPs each per (query, key, head, head-dim element, layer).

    Decode: T = batch, S = context. Causal prefill of T tokens from an empty cache: S = (T + 1) / 2."""
    return 4.0 * num_heads * head_dim * num_layers * query_tokens * keys_per_query


def memory_bound_seconds(bytes_read: float, bandwidth: float) -> float:
    """bytes / bandwidth: the time to stream what a step must read once from memory."""
    return bytes_read / bandwidth


def compute_bound_seconds(flops: float, peak_flops: float) -> float:
    """FLOPs / peak FLOP/s."""
    return flops / peak_flops


def ring_allreduce_seconds(message_bytes: float, num_devices: int, bandwidth: float) -> float:
    """2 · (Y − 1) / Y · M / bw: a ring all-reduce of M bytes over Y devices sends and receives that
    much per device (reduce-scatter, then all-gather); bw per device and direction. 0 for Y = 1.
    Per-collective latency (microseconds each) is not included."""
    if num_devices <= 1:
        return 0.0
    return 2.0 * (num_devices - 1) / num_devices * message_bytes / bandwidth


def tp_allreduce_seconds(tokens: float, hidden_size: int, activation_bytes: int, num_layers: int,
                         model_size: int, bandwidth: float) -> float:
    """2 · L · ring_allreduce(T · D · b): tensor parallelism with replicated activations all-reduces
    [T, D] twice per layer (after attention's output projection and after the MLP down projection)."""
    return 2 * num_layers * ring_allreduce_seconds(tokens * hidden_size * activation_bytes, model_size, bandwidth)


def step_seconds(memory_s: float, compute_s: float, allreduce_s: float) -> float:
    """max(memory, compute) + all-reduce: reads and multiplies overlap; the all-reduces sit between
    layers on the critical path."""
    return max(memory_s, compute_s) + allreduce_s


def cost_per_million_tokens(cost_per_device_hour: float, num_devices: int, tokens_per_second: float) -> float:
    """USD per 10⁶ tokens = cost_per_device_hour · devices / 3600 / tokens_per_second · 10⁶."""
    return cost_per_device_hour * num_devices / 3600.0 / tokens_per_second * 1e6


# ---- model arithmetic -------------------------------------------------------------------------------
def matmul_params(cfg: ModelConfig) -> int:
    """Weights that multiply activations each token: all but the input embedding, which is a gather
    (when tied, the same table is the LM head and does multiply)."""
    return cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


def sharding_rules(cfg: ModelConfig, model_size: int) -> dict[str, str | None]:
    """The engine's logical-axis rules (raises ConfigError when the model axis does not divide the heads)."""
    from jaxserve.sharding import logical_rules

    return logical_rules(cfg, model_size)


def param_bytes_per_device(cfg: ModelConfig, bytes_per_element: int, quantization: str = "none",
                           quantize_lm_head: bool = False, model_size: int = 1) -> int:
    """Bytes of parameters on each device of a model axis of `model_size` devices.

    Each array of `weights.param_specs` is split over the model axis when one of its logical axes maps
    to it (`sharding.logical_rules`), else replicated; int8 weights take 1 byte per element plus an f32
    scale per output channel, split when the output axis is. With model_size=1 this equals
    `ModelConfig.param_bytes` (checked below)."""
    import jax

    from jaxserve.model.weights import ArraySpec, param_specs
    from jaxserve.sharding import MODEL

    def count(size: int) -> int:
        rules = sharding_rules(cfg, size)
        total = 0
        leaves = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=lambda x: isinstance(x, ArraySpec))[0]
        for path, spec in leaves:
            name = getattr(path[-1], "name", str(path[-1]))
            elements = math.prod(spec.shape)
            split = size if any(a is not None and rules.get(a) == MODEL for a in spec.axes) else 1
            quantized = quantization == "int8" and (
                name in LINEAR_WEIGHTS or (name == "lm_head" and quantize_lm_head and not cfg.tie_word_embeddings))
            if quantized:
                out_channels = elements // spec.shape[-2]
                scale_split = size if rules.get(spec.axes[-1]) == MODEL else 1
                total += elements // split + out_channels * 4 // scale_split
            else:
                total += elements * bytes_per_element // split
        return total

    expected = cfg.param_bytes(bytes_per_element, quantization, quantize_lm_head)
    if count(1) != expected:  # the planner's view of the arrays must be ModelConfig's
        raise AssertionError(f"planner counts {count(1)} parameter bytes, ModelConfig.param_bytes {expected}")
    return count(model_size)


def kv_split(cfg: ModelConfig, model_size: int) -> int:
    """Devices the KV heads are split over: the model axis when it divides them, else 1 (replicated)."""
    from jaxserve.sharding import MODEL

    return model_size if sharding_rules(cfg, model_size)["kv_heads"] == MODEL else 1


# ---- the target: a device spec, how many, and overrides ---------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    """Per-device resources of a mesh (after overrides; virtual CPU devices share the host's)."""

    spec: DeviceSpec
    mesh_shape: tuple[int, int]  # (data, model)
    memory_bytes: int
    bandwidth: float
    peak_flops: float
    allreduce_bandwidth: float
    cost_per_hour: float  # per device
    overridden: tuple[str, ...] = ()

    @property
    def num_devices(self) -> int:
        return self.mesh_shape[0] * self.mesh_shape[1]

    @classmethod
    def build(cls, spec: DeviceSpec, mesh_shape: tuple[int, int], device_memory: int | None = None,
              bandwidth: float | None = None, peak_flops: float | None = None,
              cost_per_hour: float | None = None) -> "Target":
        overridden = tuple(name for name, v in (("device_memory", device_memory), ("bandwidth", bandwidth),
                                                ("peak_flops", peak_flops), ("cost_per_hour", cost_per_hour))
                           if v is not None)
        memory = device_memory or spec.memory_bytes
        bw = bandwidth or spec.hbm_bandwidth
        flops = peak_flops or spec.peak_flops
        ar_bw = spec.allreduce_bandwidth or bw / 2
        n = mesh_shape[0] * mesh_shape[1]
        if spec.shared_host:  # N virtual devices split one host (--device-memory is already per device)
            bw, flops, ar_bw = bw / n, flops / n, ar_bw / n
            memory = memory if device_memory else memory // n
        if min(memory, bw, flops) <= 0:
            raise ConfigError(f"device {spec.name!r} needs memory, bandwidth and peak FLOP/s (measured or given)")
        cost = spec.cost_per_hour if cost_per_hour is None else cost_per_hour
        return cls(spec, tuple(mesh_shape), int(memory), bw, flops, ar_bw, cost, overridden)


# ---- the plan ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepBound:
    """Lower bounds on one step of a replica, and what they imply for the whole mesh."""

    batch: int  # sequences per replica
    tokens: int  # new tokens per sequence in the step (1 for decode)
    context: int  # tokens each sequence attends to (decode) / prompt length (prefill)
    memory_s: float
    compute_s: float
    allreduce_s: float
    seconds: float
    tokens_per_s: float  # whole mesh
    usd_per_million_tokens: float


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    cfg: ModelConfig
    dtype: str
    quantization: str
    quantize_lm_head: bool
    kv_cache_dtype: str
    target: Target
    memory_fraction: float
    page_size: int
    context: int
    batch: int  # assumed decode batch per replica
    param_bytes_total: int
    param_bytes_per_device: int
    kv_bytes_per_token: int  # whole model
    kv_bytes_per_token_per_device: int
    kv_split: int  # devices each token's KV is split over (1 = replicated over the model axis)
    usable_bytes_per_device: int
    kv_budget_per_device: int  # after parameters (negative: the parameters do not fit)
    pages_per_replica: int  # usable pages of page_size tokens (the padding page excluded)
    max_batch: int  # sequences of `context` tokens that fit per replica
    decode: tuple[StepBound, ...]
    prefill: StepBound | None
    engine_pages: int | None  # pages per replica the engine would allocate with these settings
    problems: tuple[str, ...]  # why the plan does not fit; empty when it does
    notes: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def tokens_per_replica(self) -> int:
        return self.pages_per_replica * self.page_size

    @property
    def num_replicas(self) -> int:
        return self.target.mesh_shape[0]

    @property
    def usd_per_million_input_tokens(self) -> float | None:
        """At the prefill bound (compute-bound: prompt tokens are processed many to a step)."""
        return self.prefill.usd_per_million_tokens if self.prefill else None

    @property
    def usd_per_million_output_tokens(self) -> float | None:
        """At the decode bound of the planned batch (memory-bound: one token per sequence per step)."""
        planned = [d for d in self.decode if d.batch == self.batch] or list(self.decode[-1:])
        return planned[0].usd_per_million_tokens if planned else None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["cfg"] = dataclasses.asdict(self.cfg)
        out["target"]["spec"] = self.target.spec.name
        out.update(fits=self.fits, tokens_per_replica=self.tokens_per_replica,
                   usd_per_million_input_tokens=self.usd_per_million_input_tokens,
                   usd_per_million_output_tokens=self.usd_per_million_output_tokens)
        return out


def decode_bound(cfg: ModelConfig, target: Target, param_bytes_dev: int, kv_per_token_dev: int, batch: int,
                 context: int, activation_bytes: int) -> StepBound:
    """One decode step of `batch` sequences per replica, each attending to `context` tokens."""
    data, model = target.mesh_shape
    memory_s = memory_bound_seconds(param_bytes_dev + batch * context * kv_per_token_dev, target.bandwidth)
    flops = matmul_flops(matmul_params(cfg), batch) + attention_flops(
        cfg.num_heads, cfg.head_dim, cfg.num_layers, batch, context)
    compute_s = compute_bound_seconds(flops / model, target.peak_flops)
    allreduce_s = tp_allreduce_seconds(batch, cfg.hidden_size, activation_bytes, cfg.num_layers, model,
                                       target.allreduce_bandwidth)
    seconds = step_seconds(memory_s, compute_s, allreduce_s)
    tokens_per_s = data * batch / seconds
    return StepBound(batch, 1, context, memory_s, compute_s, allreduce_s, seconds, tokens_per_s,
                     cost_per_million_tokens(target.cost_per_hour, target.num_devices, tokens_per_s))


def prefill_bound(cfg: ModelConfig, target: Target, param_bytes_dev: int, kv_per_token_dev: int, prompt_len: int,
                  activation_bytes: int) -> StepBound:
    """Prefill of one `prompt_len`-token prompt on one replica (a lower bound on time to first token)."""
    data, model = target.mesh_shape
    memory_s = memory_bound_seconds(param_bytes_dev + prompt_len * kv_per_token_dev, target.bandwidth)
    flops = matmul_flops(matmul_params(cfg), prompt_len) + attention_flops(
        cfg.num_heads, cfg.head_dim, cfg.num_layers, prompt_len, (prompt_len + 1) / 2)
    compute_s = compute_bound_seconds(flops / model, target.peak_flops)
    allreduce_s = tp_allreduce_seconds(prompt_len, cfg.hidden_size, activation_bytes, cfg.num_layers, model,
                                       target.allreduce_bandwidth)
    seconds = step_seconds(memory_s, compute_s, allreduce_s)
    tokens_per_s = data * prompt_len / seconds
    return StepBound(1, prompt_len, prompt_len, memory_s, compute_s, allreduce_s, seconds, tokens_per_s,
                     cost_per_million_tokens(target.cost_per_hour, target.num_devices, tokens_per_s))


def make_plan(cfg: ModelConfig, target: Target, *, dtype: str = "bfloat16", quantization: str = "none",
              quantize_lm_head: bool = False, kv_cache_dtype: str = "auto", page_size: int = 16,
              context: int | None = None, batch: int | None = None, batch_is_required: bool = True,
              memory_fraction: float = 0.9, prompt_len: int | None = None, engine_pages: int | None = None,
              model: str = "model") -> Plan:
    """The plan for `cfg` on `target`. Refusals are collected in `problems` rather than raised.

    batch: sequences per replica at `context` (default: the most that fit). batch_is_required=False
    makes a batch that does not fit a note (the engine would preempt) rather than a refusal."""
    if not 0 < memory_fraction <= 1:
        raise ConfigError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_BYTES)} here, got {dtype!r}")
    b = DTYPE_BYTES[dtype]
    data, model_size = target.mesh_shape
    context = context or cfg.max_position_embeddings
    problems, notes = [], []
    if context > cfg.max_position_embeddings:
        problems.append(f"context {context} exceeds the model's max_position_embeddings "
                        f"{cfg.max_position_embeddings}")
    total = cfg.param_bytes(b, quantization, quantize_lm_head)
    per_device = param_bytes_per_device(cfg, b, quantization, quantize_lm_head, model_size)
    kv_token = cfg.kv_bytes_per_token(b, kv_cache_dtype)
    split = kv_split(cfg, model_size)
    kv_token_dev = kv_token // split
    if split == 1 and model_size > 1:
        notes.append(f"the {cfg.num_kv_heads} KV heads do not divide over the model axis of {model_size}: "
                     f"every device of a replica holds all of them (KV replicated)")
    usable = int(target.memory_bytes * memory_fraction)
    budget = usable - per_device
    page_bytes = kv_token_dev * page_size
    pages = max(0, budget // page_bytes - RESERVED_PAGES) if budget > 0 else 0
    pages_per_seq = math.ceil(context / page_size)
    max_batch = pages // pages_per_seq
    seq_bytes = pages_per_seq * page_bytes
    if budget <= 0:
        problems.append(
            f"parameters need {fmt_bytes(per_device)} per device; {fmt_bytes(usable)} is usable "
            f"({fmt_bytes(target.memory_bytes)} x {memory_fraction:g}): short by {fmt_bytes(-budget)} per device")
    elif max_batch < 1:
        short = (pages_per_seq + RESERVED_PAGES) * page_bytes - budget
        problems.append(
            f"one sequence of {context} tokens needs {fmt_bytes(seq_bytes)} of KV per device; "
            f"{fmt_bytes(budget)} is left after the parameters: short by {fmt_bytes(short)} per device")
    if batch is not None and batch > max_batch >= 1:
        short = (batch * pages_per_seq + RESERVED_PAGES) * page_bytes - budget
        message = (f"{batch} sequences of {context} tokens per replica need {fmt_bytes(batch * seq_bytes)} of KV "
                   f"per device; {fmt_bytes(budget)} is left after the parameters: short by {fmt_bytes(short)} "
                   f"per device (at most {max_batch} fit)")
        (problems if batch_is_required else notes).append(
            message if batch_is_required else message + "; the engine admits them and preempts when pages run out")
    if engine_pages is not None and budget > 0 and engine_pages * page_bytes > budget:
        problems.append(
            f"the configured KV cache ({engine_pages} pages of {page_size} tokens) needs "
            f"{fmt_bytes(engine_pages * page_bytes)} per device; {fmt_bytes(budget)} is left after the parameters: "
            f"short by {fmt_bytes(engine_pages * page_bytes - budget)} per device")

    decode: list[StepBound] = []
    prefill = None
    if max_batch >= 1:
        assumed = min(batch or max_batch, max_batch)
        for n in sorted({1, assumed, max_batch}):
            decode.append(decode_bound(cfg, target, per_device, kv_token_dev, n, context, b))
        prefill = prefill_bound(cfg, target, per_device, kv_token_dev, min(prompt_len or context, context), b)
    return Plan(
        model=model, cfg=cfg, dtype=dtype, quantization=quantization,
        quantize_lm_head=quantize_lm_head and quantization == "int8", kv_cache_dtype=kv_cache_dtype,
        target=target, memory_fraction=memory_fraction, page_size=page_size, context=context,
        batch=min(batch or max_batch, max_batch) if max_batch >= 1 else (batch or 0),
        param_bytes_total=total, param_bytes_per_device=per_device, kv_bytes_per_token=kv_token,
        kv_bytes_per_token_per_device=kv_token_dev, kv_split=split, usable_bytes_per_device=usable,
        kv_budget_per_device=budget, pages_per_replica=pages, max_batch=max_batch, decode=tuple(decode),
        prefill=prefill, engine_pages=engine_pages, problems=tuple(problems), notes=tuple(notes),
    )


# ---- settings -> plan ---------------------------------------------------------------------------------
def default_model_dir() -> str:
    """What `python -m jaxserve.serve` serves without --model: checkpoints/default, else the SmolLM2-135M shape."""
    from jaxserve.serve import DEFAULT_CHECKPOINT, DUMMY_DEFAULT_MODEL

    return str(DEFAULT_CHECKPOINT if (DEFAULT_CHECKPOINT / "config.json").is_file() else DUMMY_DEFAULT_MODEL)


def resolve_dtype(settings: EngineConfig, model_dir: str, spec: DeviceSpec) -> str:
    """The engine's rule (model_loader.resolve_dtype) applied to the *target* device, not the local one:
    auto = float32 on CPU, else the checkpoint's dtype, else bfloat16."""
    if settings.dtype != "auto":
        return settings.dtype
    if spec.name == "cpu":
        return "float32"
    from jaxserve.checkpoint import checkpoint_dtype

    return checkpoint_dtype(model_dir) or "bfloat16"


def configured_pages(cfg: ModelConfig, settings: EngineConfig, dtype: str, param_bytes: int) -> int:
    """Pages per replica the engine allocates for these settings (memory_plan.plan_memory)."""
    from jaxserve.memory_plan import plan_memory

    return plan_memory(cfg, settings, dtype, param_bytes).num_pages


def plan_from_settings(settings: EngineConfig, target: Target, *, context: int | None = None, batch: int | None = None,
                       memory_fraction: float = 0.9, prompt_len: int | None = None) -> Plan:
    """The plan for an EngineConfig: its model, dtype, quantization, page size and KV sizing.

    context defaults to max_model_len (else the model's limit); batch to max_num_seqs, which only
    notes (not refuses) when it does not fit, since the engine then preempts."""
    model_dir = settings.model or default_model_dir()
    cfg = ModelConfig.from_dir(model_dir)
    dtype = resolve_dtype(settings, model_dir, target.spec)
    context = context or settings.max_model_len or cfg.max_position_embeddings
    engine_pages = None
    if settings.num_pages is not None or settings.kv_cache_memory is not None:
        engine_pages = configured_pages(cfg, settings, dtype, 0)
    return make_plan(
        cfg, target, dtype=dtype, quantization=settings.quantization, quantize_lm_head=settings.quantize_lm_head,
        kv_cache_dtype=settings.kv_cache_dtype, page_size=settings.page_size, context=context,
        batch=batch or settings.max_num_seqs, batch_is_required=batch is not None, memory_fraction=memory_fraction,
        prompt_len=prompt_len, engine_pages=engine_pages, model=model_dir,
    )


def suggest_mesh(settings: EngineConfig, spec: DeviceSpec, num_devices: int, *, context: int | None = None,
                 memory_fraction: float = 0.9, device_memory: int | None = None, bandwidth: float | None = None,
                 peak_flops: float | None = None) -> tuple[tuple[int, int], Plan] | None:
    """The mesh for `num_devices` devices: the smallest model axis (fewest all-reduces) on which
    max_num_seqs sequences of `context` tokens fit per replica, else the smallest on which the plan
    fits at all; the remaining devices are data-parallel replicas. Model axes that split the KV heads
    are preferred over ones that replicate them. None when no mesh fits."""
    model_dir = settings.model or default_model_dir()
    cfg = ModelConfig.from_dir(model_dir)
    sizes = [m for m in range(1, num_devices + 1) if num_devices % m == 0 and cfg.num_heads % m == 0]
    sizes.sort(key=lambda m: (cfg.num_kv_heads % m != 0, m))
    fitting = []
    for m in sizes:
        mesh = (num_devices // m, m)
        target = Target.build(spec, mesh, device_memory, bandwidth, peak_flops)
        plan = plan_from_settings(settings.replace(mesh_shape=mesh), target, context=context,
                                  memory_fraction=memory_fraction)
        if plan.fits:
            if plan.max_batch >= settings.max_num_seqs:
                return mesh, plan
            fitting.append((mesh, plan))
    return fitting[0] if fitting else None


# ---- capacity: replicas for a request rate under a latency SLO, from a measured replica --------------
def request_goodput(requests: Sequence[dict], duration_s: float, slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None) -> tuple[float, float]:
    """(goodput in requests/s, SLO attainment) of bench_serving's per-request records (--save-requests:
    ok, ttft and e2el in seconds, output_tokens): the requests that succeeded with TTFT <= slo_ttft_ms
    and TPOT = (e2el - ttft) / (output_tokens - 1) <= slo_tpot_ms (an SLO left None is not checked),
    per second of the run, and as a share of all requests (failed ones count against it)."""
    good = 0
    for r in requests:
        if not r.get("ok"):
            continue
        if slo_ttft_ms is not None and r["ttft"] * 1e3 > slo_ttft_ms:
            continue
        n = r.get("output_tokens", 0)
        if slo_tpot_ms is not None and n > 1 and (r["e2el"] - r["ttft"]) / (n - 1) * 1e3 > slo_tpot_ms:
            continue
        good += 1
    return (good / duration_s if duration_s else 0.0), (good / len(requests) if requests else 0.0)


@dataclasses.dataclass(frozen=True)
class ReplicaCapacity:
    """The most requests/s one replica served within the SLO, and the run that showed it."""

    requests_per_s: float  # goodput of the chosen run
    attainment: float  # its share of requests within the SLO
    offered_rate: float | str  # that run's request rate (or "inf")
    mean_input_tokens: float
    mean_output_tokens: float
    p99_tpot_ms: float
    p99_ttft_ms: float
    meets_attainment: bool  # False: no run reached min_attainment; the best goodput is used anyway
    saturated: bool = False  # the run served under 90% of its offered rate: a queue was building up


def replica_capacity(runs: Sequence[dict], min_attainment: float = 0.9, slo_ttft_ms: float | None = None,
                     slo_tpot_ms: float | None = None) -> ReplicaCapacity:
    """One replica's capacity from bench_serving run summaries (one per request rate): the highest
    goodput among the runs where at least `min_attainment` of requests met the SLO (past that rate,
    queueing breaks the SLO). With an SLO given here the goodput is recomputed from each run's
    per-request records (bench_serving --save-requests); without, each run's own `goodput` (measured
    with bench_serving's --slo-ttft/--slo-tpot) is used. No run reaching `min_attainment`: the
    best goodput, marked meets_attainment=False."""
    measured = []
    for run in runs:
        if run.get("completed", 0) == 0:
            continue
        if slo_ttft_ms is not None or slo_tpot_ms is not None:
            if "requests" not in run:
                raise ConfigError("an SLO given to the capacity planner needs per-request records: run "
                                  "bench_serving.py with --save-requests (or give the SLO to bench_serving.py instead)")
            goodput, attainment = request_goodput(run["requests"], run["duration_s"], slo_ttft_ms, slo_tpot_ms)
        elif "goodput" in run:
            goodput, attainment = run["goodput"], run["slo_attainment"]
        else:
            raise ConfigError("the benchmark has no goodput: run bench_serving.py with --slo-ttft/--slo-tpot "
                              "(or --save-requests and give the SLO here)")
        measured.append((goodput, attainment, run))
    if not measured:
        raise ConfigError("the benchmark has no run with a completed request")
    meeting = [m for m in measured if m[1] >= min_attainment]
    goodput, attainment, run = max(meeting or measured, key=lambda m: m[0])
    return ReplicaCapacity(
        requests_per_s=goodput, attainment=attainment, offered_rate=run.get("request_rate", "inf"),
        mean_input_tokens=run["total_input_tokens"] / run["completed"],
        mean_output_tokens=run["total_output_tokens"] / run["completed"],
        p99_tpot_ms=run.get("p99_tpot_ms", float("nan")), p99_ttft_ms=run.get("p99_ttft_ms", float("nan")),
        meets_attainment=bool(meeting), saturated=_saturated(run))


def _saturated(run: dict) -> bool:
    """Served under 90% of a finite offered rate: in a longer run its queue, and TTFT, would keep growing."""
    rate = run.get("request_rate")
    if not isinstance(rate, (int, float)) or not math.isfinite(rate):
        return rate == "inf" or rate == float("inf")
    return run.get("request_throughput", rate) < 0.9 * rate


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    target_rate: float  # requests/s to serve
    per_replica_rate: float  # requests/s one replica serves within the SLO
    headroom: float  # extra share of capacity kept spare (0.2 = 20 %)
    replicas: int
    devices_per_replica: int
    devices: int
    utilisation: float  # target_rate / (replicas * per_replica_rate)
    cost_per_hour: float | None  # all devices, USD
    usd_per_million_input_tokens: float | None  # at the target rate, the whole cost charged to input tokens
    usd_per_million_output_tokens: float | None  # ... or to output tokens


def capacity_plan(target_rate: float, per_replica_rate: float, devices_per_replica: int = 1,
                  cost_per_device_hour: float | None = None, headroom: float = 0.0,
                  mean_input_tokens: float | None = None, mean_output_tokens: float | None = None) -> CapacityPlan:
    """Replicas = ceil(target_rate · (1 + headroom) / per_replica_rate); devices = replicas ·
    devices_per_replica; cost = devices · cost_per_device_hour. Token costs at the target rate:
    cost_per_million_tokens(cost, devices, target_rate · mean tokens per request)."""
    if target_rate <= 0 or per_replica_rate <= 0:
        raise ConfigError(f"need a positive target rate and per-replica rate, got {target_rate}, {per_replica_rate}")
    if devices_per_replica < 1 or headroom < 0:
        raise ConfigError("devices_per_replica must be >= 1 and headroom >= 0")
    replicas = max(1, math.ceil(target_rate * (1 + headroom) / per_replica_rate - 1e-9))
    devices = replicas * devices_per_replica
    cost = None if cost_per_device_hour is None else cost_per_device_hour * devices

    def per_million(tokens_per_request: float | None) -> float | None:
        if cost_per_device_hour is None or not tokens_per_request:
            return None
        return cost_per_million_tokens(cost_per_device_hour, devices, target_rate * tokens_per_request)

    return CapacityPlan(target_rate, per_replica_rate, headroom, replicas, devices_per_replica, devices,
                        target_rate / (replicas * per_replica_rate), cost, per_million(mean_input_tokens),
                        per_million(mean_output_tokens))


def build_capacity_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxserve.plan capacity",
        description="Replicas (and devices) needed to serve --target-rate requests/s within a latency SLO, from "
                    "one replica's goodput measured by scripts/bench_serving.py (its --result-json).")
    p.add_argument("bench_json", help="scripts/bench_serving.py --result-json output, runs at several rates")
    p.add_argument("--target-rate", type=float, required=True, help="requests/s to serve")
    p.add_argument("--label", default=None, help="which server of the JSON (default: the first)")
    p.add_argument("--slo-ttft", type=float, default=None,
                   help="TTFT SLO, ms (needs --save-requests records; default: the goodput the JSON holds)")
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO, ms (as --slo-ttft)")
    p.add_argument("--min-attainment", type=float, default=0.9,
                   help="share of requests that must meet the SLO at a rate for it to count")
    p.add_argument("--headroom", type=float, default=0.0, help="spare capacity to keep, e.g. 0.2 for 20%%")
    p.add_argument("--devices-per-replica", type=int, default=None,
                   help="devices one measured server used (default: the JSON's --num-devices, else 1)")
    p.add_argument("--device", default=None, help="price devices at this table entry's $/hour")
    p.add_argument("--cost-per-hour", type=float, default=None,
                   help="USD per device-hour (default: --device's, else the JSON's --cost-per-hour)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def capacity_main(argv: Sequence[str]) -> int:
    args = build_capacity_parser().parse_args(list(argv))
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
        result = capacity_plan(args.target_rate, replica.requests_per_s, per_replica, cost, args.headroom,
                               replica.mean_input_tokens, replica.mean_output_tokens)
    except (JaxServeError, ValueError, OSError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"replica": dataclasses.asdict(replica), "plan": dataclasses.asdict(result)}, indent=2))
        return 0
    slo = (f"TTFT <= {args.slo_ttft} ms, TPOT <= {args.slo_tpot} ms" if args.slo_ttft or args.slo_tpot
           else f"TTFT <= {bench_config.get('slo_ttft')} ms, TPOT <= {bench_config.get('slo_tpot')} ms")
    print(f"one replica ({label}, {per_replica} device(s)): {replica.requests_per_s:.3f} requests/s within the SLO "
          f"({slo}; {100 * replica.attainment:.1f}% of requests at offered rate {replica.offered_rate}; "
          f"p99 TPOT {replica.p99_tpot_ms:.1f} ms, p99 TTFT {replica.p99_ttft_ms:.0f} ms)")
    if replica.saturated:
        print(f"warning: that run served fewer requests/s than offered ({replica.offered_rate}): the replica was "
              "saturated and a longer run would queue more and break the TTFT SLO; the capacity is optimistic, "
              "measure a rate just below it with more prompts", file=sys.stderr)
    if not replica.meets_attainment:
        print(f"warning: no measured rate kept {100 * args.min_attainment:.0f}% of requests within the SLO; "
              "this is the best goodput seen, not a safe capacity: measure lower rates", file=sys.stderr)
    print(f"target {result.target_rate:g} requests/s (+{100 * result.headroom:.0f}% headroom): "
          f"{result.replicas} replica(s) = {result.devices} device(s), at {100 * result.utilisation:.0f}% of "
          "their measured capacity")
    if result.cost_per_hour is not None:
        print(f"cost ${result.cost_per_hour:.2f}/hour: ${result.usd_per_million_input_tokens:.4f} per million input "
              f"tokens or ${result.usd_per_million_output_tokens:.4f} per million output tokens (each charged the "
              f"whole cost; {replica.mean_input_tokens:.0f} in / {replica.mean_output_tokens:.0f} out per request)")
    return 0


# ---- output -------------------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.2f} s"


def fmt_rate(x: float) -> str:
    return f"{x / 1e12:.4g} T" if x >= 1e12 else f"{x / 1e9:.4g} G"


def describe(plan: Plan) -> str:
    t, cfg = plan.target, plan.cfg
    data, model = t.mesh_shape
    weights = "int8 linear layers" + (" and lm_head" if plan.quantize_lm_head else "") + f", the rest {plan.dtype}" \
        if plan.quantization == "int8" else plan.dtype
    kv_dtype = "int8 (+ f32 scales)" if plan.kv_cache_dtype == "int8" else plan.dtype
    overrides = f" (overridden: {', '.join(t.overridden)})" if t.overridden else ""
    lines = [
        f"model      {plan.model}: {cfg.num_params() / 1e9:.2f} B parameters, {cfg.num_layers} layers, "
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
        f"({fmt_bytes(t.memory_bytes)} x memory fraction {plan.memory_fraction:g})",
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
        lines.append(f"  engine allocates    {plan.engine_pages:>12,}   pages per replica "
                     "(num_pages / kv_cache_memory)")
    elif plan.pages_per_replica > 0:
        lines.append(f"  to use it all       num_pages: {plan.pages_per_replica + RESERVED_PAGES}   "
                     f"(the engine's default is a 2 GiB cache per replica)")
    if plan.decode:
        lines += ["", f"lower bounds (roofline: peak bandwidth and FLOP/s, no overheads; real steps are slower)",
                  f"  decode step, every sequence at {plan.context} tokens of context; cost at ${t.cost_per_hour:.2f}"
                  f" x {t.num_devices} devices per hour:",
                  f"  {'batch/replica':>13} {'memory':>11} {'compute':>11} {'all-reduce':>11} {'step ≥':>11} "
                  f"{'tokens/s ≤':>11} {'$/M tokens ≥':>13}"]
        for d in plan.decode:
            lines.append(f"  {d.batch:>13,} {fmt_seconds(d.memory_s):>11} {fmt_seconds(d.compute_s):>11} "
                         f"{fmt_seconds(d.allreduce_s):>11} {fmt_seconds(d.seconds):>11} {d.tokens_per_s:>11,.0f} "
                         f"{d.usd_per_million_tokens:>13.4f}")
        p = plan.prefill
        lines.append(f"  prefill of one {p.tokens}-token prompt: ≥ {fmt_seconds(p.seconds)} (compute "
                     f"{fmt_seconds(p.compute_s)}, memory {fmt_seconds(p.memory_s)}, all-reduce "
                     f"{fmt_seconds(p.allreduce_s)}): time to first token ≥ that")
        lines.append(f"  cost at the bounds: ≥ ${p.usd_per_million_tokens:.4f} per million input (prompt) tokens "
                     f"(prefill, {p.tokens_per_s:,.0f} tokens/s ≤), ≥ ${plan.usd_per_million_output_tokens:.4f} per "
                     f"million output tokens (decode at batch {plan.batch}/replica)")
        if model > 1:
            lines.append(f"  all-reduce: 2 x {cfg.num_layers} per step (+ a few µs of latency each, not counted)")
    for note in plan.notes:
        lines.append(f"note: {note}")
    if plan.problems:
        lines += ["", "DOES NOT FIT:"] + [f"  - {p}" for p in plan.problems]
        lines.append("  try: more devices on the model axis, quantization: int8, kv_cache_dtype: int8, "
                     "a shorter context or a smaller batch")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxserve.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML file of engine settings; flags override it")
    g = parser.add_argument_group("target")
    g.add_argument("--device", default=None,
                   help=f"device from the table ({', '.join(DEVICES)}) or 'auto' (the one jax sees here); "
                        f"default: {DEFAULT_DEVICE}")
    g.add_argument("--devices", type=int, default=None,
                   help="number of devices; default: data x model of mesh_shape (a 1,1 mesh becomes 1,N)")
    g.add_argument("--device-memory", type=_size, default=None, help="memory per device, e.g. 80GiB (override)")
    g.add_argument("--bandwidth", type=_rate, default=None,
                   help="memory bandwidth per device in bytes/s, e.g. 3.35e12 or 50GB (override; for 'cpu' the "
                        "whole host's, else measured)")
    g.add_argument("--peak-flops", type=_rate, default=None, help="peak FLOP/s per device (override)")
    g.add_argument("--cost-per-hour", type=float, default=None, help="USD per device-hour (override)")
    g.add_argument("--measure-bandwidth", action="store_true",
                   help="measure this host's copy bandwidth and matmul FLOP/s now and print them (for --device cpu)")
    g.add_argument("--list-devices", action="store_true", help="print the device table and exit")
    g.add_argument("--suggest-mesh", action="store_true",
                   help="print only the mesh_shape to use on --devices devices (all local ones with --device auto), "
                        "e.g. 8,1: the smallest model axis that fits, the rest data-parallel")
    w = parser.add_argument_group("workload")
    w.add_argument("--context", type=int, default=None, help="tokens per sequence; default: max_model_len")
    w.add_argument("--batch", type=int, default=None,
                   help="decode batch per replica to plan for (refused if it does not fit); default: max_num_seqs")
    w.add_argument("--prompt-len", type=int, default=None, help="prompt length of the prefill bound; default: context")
    w.add_argument("--memory-fraction", type=float, default=0.9,
                   help="share of device memory for parameters + KV (the rest: activations, workspace)")
    w.add_argument("--json", action="store_true", help="print the plan as JSON")
    EngineConfig.add_cli_arguments(parser)
    return parser


def list_devices() -> str:
    rows = [f"{'name':<9} {'memory':>10} {'HBM B/s':>9} {'bf16 FLOP/s':>12} {'all-reduce B/s':>15} "
            f"{'$/hour':>7}  description"]
    for s in DEVICES.values():
        if s.name == "cpu":
            rows.append(f"{'cpu':<9} {'host RAM':>10} {'measured':>9} {'measured':>12} {'bw / 2':>15} "
                        f"{s.cost_per_hour:>7.2f}  {s.description}")
            continue
        rows.append(f"{s.name:<9} {fmt_bytes(s.memory_bytes):>10} {fmt_rate(s.hbm_bandwidth):>9} "
                    f"{fmt_rate(s.peak_flops):>12} {fmt_rate(s.allreduce_bandwidth):>15} {s.cost_per_hour:>7.2f}  "
                    f"{s.description}")
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
                raise ConfigError(f"the local device {kind!r} is not in the device table; pass --device NAME, or "
                                  "--device-memory, --bandwidth and --peak-flops")
            spec = DeviceSpec(kind.lower(), kind, 0, 0.0, 0.0, 0.0, 0.0)
            return spec, local_count
        name = spec.name
    spec = get_device(name)
    if spec.name == "cpu":
        spec = cpu_spec(args.bandwidth, args.peak_flops)
    return spec, local_count


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["capacity"]:
        return capacity_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_devices:
        print(list_devices())
        return 0
    try:
        if args.measure_bandwidth:
            from jaxserve.devices import measure_copy_bandwidth, measure_matmul_flops

            bw, flops = measure_copy_bandwidth(), measure_matmul_flops()
            print(f"this host: numpy copy {bw / 1e9:.1f} GB/s (read + write), f32 matmul {flops / 1e9:.0f} GFLOP/s")
            args.bandwidth = args.bandwidth or bw
            args.peak_flops = args.peak_flops or flops
        values = EngineConfig.cli_values(args)
        settings = EngineConfig.from_yaml(args.config, values) if args.config else EngineConfig.from_dict(values)
        spec, local_count = resolve_spec(args.device, settings, args)
        if args.suggest_mesh:
            n = args.devices or local_count or settings.mesh_shape[0] * settings.mesh_shape[1]
            found = suggest_mesh(settings, spec, n, context=args.context, memory_fraction=args.memory_fraction,
                                 device_memory=args.device_memory, bandwidth=args.bandwidth,
                                 peak_flops=args.peak_flops)
            if found is None:
                print(f"error: no mesh of {n} x {spec.name} fits this model at this context", file=sys.stderr)
                return EXIT_DOES_NOT_FIT
            (data, model), plan = found
            print(f"{data},{model}")
            print(f"mesh ({data}, {model}) on {n} x {spec.name}: {fmt_bytes(plan.param_bytes_per_device)} of "
                  f"parameters per device, {plan.max_batch * data} sequences of {plan.context} tokens fit",
                  file=sys.stderr)
            return 0
        mesh = resolve_mesh(settings.mesh_shape, args.devices)
        target = Target.build(spec, mesh, args.device_memory, args.bandwidth, args.peak_flops, args.cost_per_hour)
        plan = plan_from_settings(settings, target, context=args.context, batch=args.batch,
                                  memory_fraction=args.memory_fraction, prompt_len=args.prompt_len)
    except (JaxServeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2, default=str))
    else:
        print(describe(plan))
    if not plan.fits:
        print(f"error: the plan does not fit: {'; '.join(plan.problems)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
