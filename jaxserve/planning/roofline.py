"""The planner's memory and roofline model: will a model fit on a mesh of devices, how many sequences,
and how fast at best.

Small pure functions of numbers (`*_seconds`, `*_flops`, `cost_per_million_tokens`) that scripts reuse;
`make_plan` applies them to a `ModelConfig` on a `Target` (a `jaxserve.planning.devices` spec, a mesh,
overrides); `jaxserve.planning.mesh` applies `make_plan` to an `EngineConfig` and picks a mesh. The byte
counts come from `ModelConfig.param_bytes` / `kv_bytes_per_token`, and which arrays are split over the
`model` axis from `sharding.logical_rules` (`planning/weight_bytes.py`), so the plan cannot drift from
what the engine allocates.

Every bound is a *lower* bound on time (an upper bound on throughput): the step reads each weight and
each sequence's KV once at peak bandwidth, multiplies at peak FLOP/s, and all-reduces at peak
interconnect bandwidth with no latency. `python -m jaxserve.plan` (jaxserve/plan.py) prints a plan.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.config.model_config import SUPPORTED_ARCHITECTURES
from jaxserve.planning.devices import DeviceSpec
from jaxserve.errors import ConfigError
from jaxserve.planning.memory import RESERVED_PAGES
from jaxserve.planning.weight_bytes import (
    EXPERT_WEIGHTS,
    kv_split,
    matmul_params,
    param_bytes_per_device,
    param_bytes_read_per_device,
)

GiB, MiB, KiB = 2**30, 2**20, 2**10
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---- the roofline arithmetic: pure functions of numbers ------------------------------------------
def matmul_flops(params: float, tokens: float) -> float:
    """2 · P · T: one multiply-add per weight per token (P = weights that multiply activations)."""
    return 2.0 * params * tokens


def attention_flops(
    num_heads: int, head_dim: int, num_layers: int, query_tokens: float, keys_per_query: float
) -> float:
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


def tp_allreduce_seconds(
    tokens: float, hidden_size: int, activation_bytes: int, num_layers: int, model_size: int, bandwidth: float
) -> float:
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
    def build(
        cls,
        spec: DeviceSpec,
        mesh_shape: tuple[int, int],
        device_memory: int | None = None,
        bandwidth: float | None = None,
        peak_flops: float | None = None,
        cost_per_hour: float | None = None,
    ) -> "Target":
        overridden = tuple(
            name
            for name, v in (
                ("device_memory", device_memory),
                ("bandwidth", bandwidth),
                ("peak_flops", peak_flops),
                ("cost_per_hour", cost_per_hour),
            )
            if v is not None
        )
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
    weight_bytes: float = 0.0  # parameter bytes the (busiest) device reads in the step
    experts_read: float = 0.0  # MoE: distinct experts read per layer (expected, uniform routing); 0 dense


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
    active_params: int = 0  # parameters one token reads (top-k experts); = cfg.num_params() when dense
    expert_parallel: bool = False  # MoE: whole experts split over the model axis (else each expert split)
    mesh_reason: str = ""  # suggest_mesh: why this mesh (and, for MoE, expert- or tensor-parallel)

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
        out.update(
            fits=self.fits,
            tokens_per_replica=self.tokens_per_replica,
            usd_per_million_input_tokens=self.usd_per_million_input_tokens,
            usd_per_million_output_tokens=self.usd_per_million_output_tokens,
        )
        return out


def decode_bound(
    cfg: ModelConfig,
    target: Target,
    param_bytes_dev: float,
    kv_per_token_dev: int,
    batch: int,
    context: int,
    activation_bytes: int,
) -> StepBound:
    """One decode step of `batch` sequences per replica, each attending to `context` tokens.

    param_bytes_dev: the parameter bytes the step reads per device: all it holds for a dense model,
    for a mixture of experts only the experts the batch is routed to (`param_bytes_read_per_device`)."""
    data, model = target.mesh_shape
    memory_s = memory_bound_seconds(param_bytes_dev + batch * context * kv_per_token_dev, target.bandwidth)
    flops = matmul_flops(matmul_params(cfg), batch) + attention_flops(
        cfg.num_heads, cfg.head_dim, cfg.num_layers, batch, context
    )
    compute_s = compute_bound_seconds(flops / model, target.peak_flops)
    allreduce_s = tp_allreduce_seconds(
        batch, cfg.hidden_size, activation_bytes, cfg.num_layers, model, target.allreduce_bandwidth
    )
    seconds = step_seconds(memory_s, compute_s, allreduce_s)
    tokens_per_s = data * batch / seconds
    return StepBound(
        batch,
        1,
        context,
        memory_s,
        compute_s,
        allreduce_s,
        seconds,
        tokens_per_s,
        cost_per_million_tokens(target.cost_per_hour, target.num_devices, tokens_per_s),
        param_bytes_dev,
        cfg.expected_experts_read(batch),
    )


def prefill_bound(
    cfg: ModelConfig,
    target: Target,
    param_bytes_dev: float,
    kv_per_token_dev: int,
    prompt_len: int,
    activation_bytes: int,
) -> StepBound:
    """Prefill of one `prompt_len`-token prompt on one replica (a lower bound on time to first token)."""
    data, model = target.mesh_shape
    memory_s = memory_bound_seconds(param_bytes_dev + prompt_len * kv_per_token_dev, target.bandwidth)
    flops = matmul_flops(matmul_params(cfg), prompt_len) + attention_flops(
        cfg.num_heads, cfg.head_dim, cfg.num_layers, prompt_len, (prompt_len + 1) / 2
    )
    compute_s = compute_bound_seconds(flops / model, target.peak_flops)
    allreduce_s = tp_allreduce_seconds(
        prompt_len, cfg.hidden_size, activation_bytes, cfg.num_layers, model, target.allreduce_bandwidth
    )
    seconds = step_seconds(memory_s, compute_s, allreduce_s)
    tokens_per_s = data * prompt_len / seconds
    return StepBound(
        1,
        prompt_len,
        prompt_len,
        memory_s,
        compute_s,
        allreduce_s,
        seconds,
        tokens_per_s,
        cost_per_million_tokens(target.cost_per_hour, target.num_devices, tokens_per_s),
        param_bytes_dev,
        cfg.expected_experts_read(prompt_len),
    )


def make_plan(
    cfg: ModelConfig,
    target: Target,
    *,
    dtype: str = "bfloat16",
    quantization: str = "none",
    quantize_lm_head: bool = False,
    kv_cache_dtype: str = "auto",
    page_size: int = 16,
    context: int | None = None,
    batch: int | None = None,
    batch_is_required: bool = True,
    memory_fraction: float = 0.9,
    prompt_len: int | None = None,
    engine_pages: int | None = None,
    model: str = "model",
    expert_parallel: bool = False,
    group_size: int | None = None,
) -> Plan:
    """The plan for `cfg` on `target`. Refusals are collected in `problems` rather than raised.

    batch: sequences per replica at `context` (default: the most that fit). batch_is_required=False
    makes a batch that does not fit a note (the engine would preempt) rather than a refusal.
    expert_parallel (mixture of experts): whole experts split over the model axis instead of every
    expert's hidden dimension (`sharding_rules`). Decode and prefill bounds read only the experts the
    step's rows are routed to (`param_bytes_read_per_device`)."""
    if not 0 < memory_fraction <= 1:
        raise ConfigError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_BYTES)} here, got {dtype!r}")
    b = DTYPE_BYTES[dtype]
    data, model_size = target.mesh_shape
    context = context or cfg.max_position_embeddings
    problems, notes = [], []
    if context > cfg.max_position_embeddings:
        problems.append(f"context {context} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}")
    total = cfg.param_bytes(b, quantization, quantize_lm_head, group_size)
    per_device = param_bytes_per_device(
        cfg, b, quantization, quantize_lm_head, model_size, expert_parallel, group_size=group_size
    )
    experts_dev = (
        param_bytes_per_device(
            cfg,
            b,
            quantization,
            quantize_lm_head,
            model_size,
            expert_parallel,
            only=EXPERT_WEIGHTS,
            group_size=group_size,
        )
        if cfg.is_moe
        else 0
    )
    expert_parallel = expert_parallel and cfg.is_moe

    def weights_read(rows: int) -> float:
        return param_bytes_read_per_device(cfg, rows, per_device, experts_dev, model_size, expert_parallel)

    if not cfg.servable:
        why = (
            "dense MLP layers among its expert layers"
            if cfg.architecture in SUPPORTED_ARCHITECTURES
            else "no forward for it"
        )
        notes.append(f"{cfg.architecture}: jaxserve plans it but cannot serve it yet ({why})")
    if cfg.architecture == "Gemma3ForConditionalGeneration":
        notes.append(
            "parameters: the text tower only (the checkpoint's SigLIP vision tower and projector, "
            "about 0.4 B more, are not counted)"
        )
    if cfg.is_moe:
        notes.append(
            f"experts read per step: E·(1 − (1 − k/E)^B) of the {cfg.num_experts} per layer for B rows "
            f"(k = {cfg.num_experts_per_tok}, uniform routing; a skewed router reads fewer)"
        )
    kv_token = cfg.kv_bytes_per_token(b, kv_cache_dtype)
    split = kv_split(cfg, model_size)
    kv_token_dev = kv_token // split
    if split == 1 and model_size > 1:
        notes.append(
            f"the {cfg.num_kv_heads} KV heads do not divide over the model axis of {model_size}: "
            f"every device of a replica holds all of them (KV replicated)"
        )
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
            f"({fmt_bytes(target.memory_bytes)} x {memory_fraction:g}): short by {fmt_bytes(-budget)} per device"
        )
    elif max_batch < 1:
        short = (pages_per_seq + RESERVED_PAGES) * page_bytes - budget
        problems.append(
            f"one sequence of {context} tokens needs {fmt_bytes(seq_bytes)} of KV per device; "
            f"{fmt_bytes(budget)} is left after the parameters: short by {fmt_bytes(short)} per device"
        )
    if batch is not None and batch > max_batch >= 1:
        short = (batch * pages_per_seq + RESERVED_PAGES) * page_bytes - budget
        message = (
            f"{batch} sequences of {context} tokens per replica need {fmt_bytes(batch * seq_bytes)} of KV "
            f"per device; {fmt_bytes(budget)} is left after the parameters: short by {fmt_bytes(short)} "
            f"per device (at most {max_batch} fit)"
        )
        (problems if batch_is_required else notes).append(
            message if batch_is_required else message + "; the engine admits them and preempts when pages run out"
        )
    if engine_pages is not None and budget > 0 and engine_pages * page_bytes > budget:
        problems.append(
            f"the configured KV cache ({engine_pages} pages of {page_size} tokens) needs "
            f"{fmt_bytes(engine_pages * page_bytes)} per device; {fmt_bytes(budget)} is left after the parameters: "
            f"short by {fmt_bytes(engine_pages * page_bytes - budget)} per device"
        )

    decode: list[StepBound] = []
    prefill = None
    if max_batch >= 1:
        assumed = min(batch or max_batch, max_batch)
        for n in sorted({1, assumed, max_batch}):
            decode.append(decode_bound(cfg, target, weights_read(n), kv_token_dev, n, context, b))
        prompt = min(prompt_len or context, context)
        prefill = prefill_bound(cfg, target, weights_read(prompt), kv_token_dev, prompt, b)
    if cfg.num_sliding_layers and cfg.layer_types and max_batch >= 1 and budget > 0:
        windowed = cfg.kv_bytes_per_sequence(context, b, kv_cache_dtype) // split
        notes.append(
            f"{cfg.num_sliding_layers} of {cfg.num_layers} layers see only the last {cfg.sliding_window} tokens, "
            f"but one KV pool gives every layer all {context}: a pool per layer group would need "
            f"{fmt_bytes(windowed)} per sequence per device instead of {fmt_bytes(seq_bytes)}, "
            f"about {budget // max(windowed, 1):,} sequences per replica instead of {max_batch:,}"
        )
    return Plan(
        model=model,
        cfg=cfg,
        dtype=dtype,
        quantization=quantization,
        quantize_lm_head=quantize_lm_head and quantization in ("int8", "int4"),
        kv_cache_dtype=kv_cache_dtype,
        target=target,
        memory_fraction=memory_fraction,
        page_size=page_size,
        context=context,
        batch=min(batch or max_batch, max_batch) if max_batch >= 1 else (batch or 0),
        param_bytes_total=total,
        param_bytes_per_device=per_device,
        kv_bytes_per_token=kv_token,
        kv_bytes_per_token_per_device=kv_token_dev,
        kv_split=split,
        usable_bytes_per_device=usable,
        kv_budget_per_device=budget,
        pages_per_replica=pages,
        max_batch=max_batch,
        decode=tuple(decode),
        prefill=prefill,
        engine_pages=engine_pages,
        problems=tuple(problems),
        notes=tuple(notes),
        active_params=cfg.active_params(),
        expert_parallel=expert_parallel,
    )


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
