"""How the KV cache is sized, as vLLM sizes it, and the plan logged at start-up.

Pages per replica come from, in order: `num_pages`; `kv_cache_memory` (bytes); on an accelerator,
what `gpu_memory_utilization` of each device leaves once the weights are loaded,

    KV bytes per device = gpu_memory_utilization x device memory - bytes in use (the weights) - reserve

(`reserve`: XLA's workspaces and compile-time scratch, and the activations of the largest step),
read from `jax.Device.memory_stats()`; and on a CPU, or an accelerator whose allocator reports no
figures, a fixed 2 GiB, capped at what max_num_seqs sequences of max_model_len need. Bytes come
from ModelConfig's arithmetic (`param_bytes`, `kv_bytes_per_token`), shared with the planner, for
the chosen dtype, weight quantization and KV-cache dtype. The device figures are an input
(`DeviceMemory`), so the accelerator arithmetic is tested on a CPU.

JAX's GPU allocator takes 75% of each GPU by default (XLA_PYTHON_CLIENT_MEM_FRACTION, or its newer
name XLA_CLIENT_MEM_FRACTION); `apply_memory_utilization` sets it to gpu_memory_utilization before
the backend starts, so that the two agree. Host-only at import: jax is imported where it is used.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from typing import Any, MutableMapping

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.config.engine_config import FP8_KV_CACHE_DTYPES
from jaxserve.config.model_config import resolved_group_size
from jaxserve.errors import ConfigError
from jaxserve.lora.peft_adapter import lora_stack_bytes

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 2 * 2**30  # a CPU's pool (and an accelerator's whose allocator reports no figures)
RESERVED_PAGES = 1  # page 0 of each replica is the padding page
# Device memory the KV cache leaves free beside the step's activations: XLA's workspaces (cuBLAS/cuDNN),
# the buffers of collectives and the scratch of compile-time autotuning, which vLLM measures in a profile
# run and jaxserve, compiling after the cache is allocated, sets aside.
FIXED_RESERVE = 2**30
XLA_DEFAULT_MEM_FRACTION = 0.75  # JAX's GPU allocator's share of each GPU when no variable sets it
# The allocator's share, as jaxlib reads it: XLA_CLIENT_MEM_FRACTION, else XLA_PYTHON_CLIENT_MEM_FRACTION (both at
# once is an error in the CUDA plugin, so a user's setting of either is kept). jaxserve sets the second:
# every jax in pyproject's range reads it (0.10.2's source; measured on 0.11.2).
MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
SET_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One accelerator's memory as JAX's allocator reports it (`jax.Device.memory_stats()`), once the
    weights are loaded; for several devices, the fullest one's figures.

    total: the device's memory, of which gpu_memory_utilization is a fraction; None where the allocator
        reports no figures (a CPU; a GPU under XLA_PYTHON_CLIENT_ALLOCATOR=platform)
    in_use: bytes allocated on it now (the weights and whatever else is loaded)
    limit: the most JAX's allocator will hand out (a GPU's: total x its memory fraction); None = total"""

    total: int | None
    in_use: int = 0
    limit: int | None = None
    platform: str = "gpu"


CPU = DeviceMemory(None, platform="cpu")


def apply_memory_utilization(utilization: float, environ: MutableMapping[str, str] | None = None) -> str:
    """Before JAX's backend starts, let its GPU allocator take `utilization` of each GPU (vLLM's meaning of
    gpu_memory_utilization) instead of its default 75%, unless the user set the fraction. Returns what
    was done, for the log. Call it before anything touches a device: once the backend is up, the
    allocator keeps the fraction it started with, and this only says so (it checks without starting
    the backend). Harmless on a TPU or a CPU, which do not read the variable."""
    environ = os.environ if environ is None else environ
    for name in MEM_FRACTION_VARS:
        if environ.get(name):
            return f"{name}={environ[name]} (set by the user) kept for JAX's GPU allocator"
    if backend_initialized():
        return (
            f"JAX's backend is already initialised: its GPU allocator keeps the fraction it started with "
            f"({XLA_DEFAULT_MEM_FRACTION:g} unless set), not gpu_memory_utilization={utilization:g}"
        )
    environ[SET_FRACTION_VAR] = f"{utilization:g}"
    return f"{SET_FRACTION_VAR}={utilization:g}: JAX's GPU allocator may take that share of each GPU"


def backend_initialized() -> bool:
    """Whether JAX's backend has started, without starting it (False when jax is not even imported)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge  # private, but what jax.distributed itself checks

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True  # cannot tell: assume the worst (the variable would come too late)


def allocator_fraction(environ: MutableMapping[str, str] | None = None) -> float:
    """The share of each GPU JAX's allocator was started with (its variables, else XLA's 0.75)."""
    environ = os.environ if environ is None else environ
    for name in MEM_FRACTION_VARS:
        if environ.get(name):
            try:
                return float(environ[name])
            except ValueError:
                break
    return XLA_DEFAULT_MEM_FRACTION


def query_device_memory(num_devices: int | None = None) -> DeviceMemory:
    """The local devices' figures (the first `num_devices` of the mesh, those of this process): the
    smallest limit and the largest use among them. On a GPU the device's memory is the allocator's
    limit over its fraction (XLA sizes its pool as total x fraction); on a TPU the limit is the
    device's memory. A CPU, or a device whose allocator reports no `bytes_limit`, gives total=None."""
    import jax

    devices = [d for d in jax.devices()[:num_devices] if d.process_index == jax.process_index()] or jax.local_devices()
    platform = devices[0].platform
    if platform == "cpu":
        return CPU
    stats = [d.memory_stats() or {} for d in devices]
    if any("bytes_limit" not in s for s in stats):
        return DeviceMemory(None, platform=platform)
    limit = min(int(s["bytes_limit"]) for s in stats)
    in_use = max(int(s.get("bytes_in_use", 0)) for s in stats)
    total = int(limit / allocator_fraction()) if platform == "gpu" else limit
    return DeviceMemory(total, in_use, limit, platform)


def activation_reserve(cfg: ModelConfig, settings: EngineConfig, itemsize: int) -> int:
    """Bytes to leave beside the KV cache: FIXED_RESERVE plus twice the largest step's activations
    (its token rows through one layer at a time, and the f32 logits of the rows it samples).

    An estimate where vLLM measures a profile run; twice, for the buffers XLA keeps live across a layer
    and the f32 copies of norms and softmaxes. With attention_backend=reference the attention scores
    of a prompt chunk against the whole context are held too."""
    speculative = 1 + settings.num_speculative_tokens
    rows = max(settings.max_num_batched_tokens, settings.max_num_seqs * speculative)
    d, h = cfg.hidden_size, cfg.head_dim
    mlp = max(cfg.intermediate_size, cfg.num_experts_per_tok * cfg.moe_intermediate_size)
    per_row = (4 * d + 2 * cfg.num_heads * h + 2 * cfg.num_kv_heads * h + 3 * mlp) * itemsize
    sampled = rows if settings.enable_prompt_logprobs else settings.max_num_seqs * speculative
    logits = 3 * sampled * cfg.vocab_size * 4  # logits, probabilities, sorted (top-k / top-p), f32
    scores = 0
    if settings.attention_backend == "reference":
        context = settings.max_model_len or cfg.max_position_embeddings
        scores = settings.max_num_batched_tokens * cfg.num_heads * context * 4
    return FIXED_RESERVE + 2 * (rows * per_row + logits + scores)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    param_bytes: int
    kv_bytes_per_token: int
    page_size: int
    num_pages: int  # per replica, the padding page included
    max_model_len: int
    max_pages_per_seq: int
    dtype: str = "float32"  # the model dtype
    quantization: str = "none"  # weights: "none" | "int8" | "int4"
    quantization_group_size: int = 0  # input rows per scale (int8 0: per output channel)
    quantize_lm_head: bool = False
    has_experts: bool = False  # a MoE model: its experts are quantized too
    activation_quantization: str = "none"  # "int8": W8A8
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "int8" | "fp8" | "fp8_e4m3" | "fp8_e5m2"
    kv_bytes_per_token_model_dtype: int | None = None  # what a cache in the model dtype would take
    draft_kv_bytes_per_token: int = 0  # speculative decoding: the draft's cache, in the same pages
    num_layers: int = 0
    num_sliding_layers: int = (
        0  # layers that see only the last `sliding_window` keys (Mistral: all; Gemma 3: the local ones)
    )
    sliding_window: int | None = None
    num_replicas: int = 1  # data-parallel replicas, each with num_pages pages
    sizing: str = ""  # how num_pages was chosen, in words (the start-up log)
    lora_bytes: int = 0  # LoRA serving: the resident adapters' stacks, counted in param_bytes (read every step)
    host_kv_bytes: int = 0  # the prefix cache's host tier (--kv-offloading-size): host memory, not device

    @property
    def page_bytes(self) -> int:
        """Bytes of one page, every layer (what the host tier stores per page)."""
        return self.page_size * self.kv_bytes_per_token

    @property
    def window_unread_bytes(self) -> int:
        """Bytes of this cache no query reads when it is full of max_model_len sequences: the sliding
        layers' share of each sequence's pages behind its window. One pool gives every layer the
        whole context; only where every layer is windowed does the block manager hand those pages
        back (`BlockManager.release_outside_window`); a mixed model (Gemma 3) would need a pool per
        layer group to use them."""
        if not (self.num_sliding_layers and self.sliding_window) or self.max_model_len <= self.sliding_window:
            return 0
        behind = (self.max_model_len - self.sliding_window) / self.max_model_len
        return int(self.kv_cache_bytes * self.num_sliding_layers / self.num_layers * behind)

    @property
    def tokens_in_model_dtype(self) -> int:
        """Tokens the same cache bytes would hold in the model dtype (whole pages, padding page excluded)."""
        per_token = self.kv_bytes_per_token_model_dtype or self.kv_bytes_per_token
        return max(self.kv_cache_bytes // (per_token * self.page_size) - RESERVED_PAGES, 0) * self.page_size

    @property
    def tokens_that_fit(self) -> int:
        return (self.num_pages - RESERVED_PAGES) * self.page_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_pages * self.page_size * self.kv_bytes_per_token

    def capacity_line(self) -> str:
        """vLLM's start-up line: the pool in tokens and how many requests of max_model_len it holds at once,
        e.g. `KV cache: 462,144 tokens; maximum concurrency for 8,192 tokens per request: 56.41x`."""
        tokens = self.tokens_that_fit
        text = (
            f"KV cache: {tokens:,} tokens; maximum concurrency for {self.max_model_len:,} tokens per request: "
            f"{tokens / self.max_model_len:.2f}x"
        )
        if self.num_replicas > 1:
            text += (
                f" (per data-parallel replica; {self.num_replicas} replicas hold {tokens * self.num_replicas:,} tokens)"
            )
        return text

    def describe_weights(self) -> str:
        """What was quantized and how, e.g. "int8 linear layers and the head, a scale per 64 input rows"."""
        if self.quantization not in ("int8", "int4"):
            return self.dtype
        what = f"{self.quantization} linear layers"
        if self.quantization == "int4":  # "dense": the model has no experts; int8 always covered them
            what = "int4 linear layers (experts included)" if self.has_experts else "int4 dense linear layers"
        what += " and the head" if self.quantize_lm_head else ""
        if self.quantization == "int8" and not self.quantization_group_size:
            w8a8 = (
                ", each matmul's input quantized to int8 per token (W8A8)"
                if self.activation_quantization == "int8"
                else ""
            )
            return f"{what}, a scale per output channel{w8a8}"
        how = "a scale" if self.quantization == "int8" else "a scale and a bias"
        return f"{what}, {how} per {self.quantization_group_size} input rows"

    def describe_kv(self) -> str:
        """How the cache stores K/V, e.g. "float8 e4m3 + f32 scales per layer"."""
        if self.kv_cache_dtype == "int8":
            return "int8 + f32 scales"
        if self.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
            fmt = "e5m2" if self.kv_cache_dtype == "fp8_e5m2" else "e4m3"
            return f"float8 {fmt} + f32 scales per layer"
        return self.dtype

    def describe(self) -> str:
        gib = 2**30
        weights = self.describe_weights()
        kv = self.describe_kv()
        text = (
            f"memory plan: params {self.param_bytes / gib:.3f} GiB ({weights}, {self.dtype} activations); "
            f"KV {self.kv_bytes_per_token} bytes/token ({kv}); "
            f"{self.num_pages} pages x {self.page_size} tokens = {self.kv_cache_bytes / gib:.3f} GiB per replica, "
            f"{self.tokens_that_fit} tokens fit; max_model_len {self.max_model_len} "
            f"({self.max_pages_per_seq} pages/sequence)"
        )
        if self.sizing:
            text += f"; pool: {self.sizing}"
        if self.draft_kv_bytes_per_token:
            draft = self.num_pages * self.page_size * self.draft_kv_bytes_per_token
            text += (
                f"; speculation's KV (a draft model's, or an EAGLE-3 head's and its stored states) "
                f"{self.draft_kv_bytes_per_token} bytes/token in the same pages "
                f"(+{draft / gib:.3f} GiB)"
            )
        if self.host_kv_bytes:
            text += "; " + host_tier_line(self.host_kv_bytes, self.page_bytes, self.num_pages - RESERVED_PAGES)
        if self.window_unread_bytes:
            every = self.num_sliding_layers == self.num_layers
            fate = (
                "the block manager can release the pages behind it"
                if every
                else "one pool for local and global layers holds them anyway"
            )
            who = "every layer sees" if every else f"{self.num_sliding_layers} of {self.num_layers} layers see"
            text += (
                f"; {who} only the last {self.sliding_window} tokens: at max_model_len "
                f"{self.window_unread_bytes / gib:.3f} GiB of this cache is never read ({fate})"
            )
        if self.kv_cache_dtype != "auto" and self.kv_bytes_per_token_model_dtype:
            base = self.tokens_in_model_dtype
            more = self.tokens_that_fit - base
            ratio = f", {self.tokens_that_fit / base:.2f}x" if base else ""
            text += (
                f"; {self.kv_cache_dtype} KV: {more} more tokens fit than in {self.dtype} "
                f"({self.kv_bytes_per_token_model_dtype} bytes/token: {base} tokens in these bytes{ratio})"
            )
        return text


def host_tier_line(host_bytes: int, page_bytes: int, device_pages: int) -> str:
    """The host tier in words: its pages, and how many times the device pool's (per replica) they are."""
    pages = host_bytes // page_bytes
    times = f", {pages / device_pages:.1f}x the device pool" if device_pages > 0 else ""
    return (
        f"host tier (--kv-offloading-size) {host_bytes / GIB:.3f} GiB of host memory: {pages:,} pages of "
        f"{page_bytes:,} bytes{times}"
    )


def plan_memory(
    cfg: ModelConfig,
    settings: EngineConfig,
    dtype: Any,
    param_bytes: int | None = None,
    draft_kv_bytes_per_token: int = 0,
    device_memory: DeviceMemory | None = None,
) -> MemoryPlan:
    """Pages per replica and the byte figures; `param_bytes` defaults to ModelConfig's arithmetic for
    the settings' quantization (the engine checks it against the loaded params). A speculative draft
    model keeps its K/V in the same pages, so a memory budget buys pages of both.

    `device_memory`: the devices' figures for sizing the pool when neither num_pages nor
    kv_cache_memory is set; None reads them from the local devices (`query_device_memory`), which the
    engine does once the weights are loaded. `CPU` (or total=None) gives the fixed default."""
    import jax.numpy as jnp

    max_model_len = settings.max_model_len or cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={cfg.max_position_embeddings}"
        )
    page_size = settings.page_size
    itemsize = jnp.dtype(dtype).itemsize
    kv_per_token = cfg.kv_bytes_per_token(itemsize, settings.kv_cache_dtype)
    lora_bytes = (
        lora_stack_bytes(cfg, settings.max_loras, settings.max_lora_rank, itemsize, settings.lora_target_modules)
        if settings.enable_lora
        else 0
    )
    if param_bytes is None:
        param_bytes = (
            cfg.param_bytes(
                itemsize, settings.quantization, settings.quantize_lm_head, settings.quantization_group_size
            )
            + lora_bytes
        )
    max_pages_per_seq = math.ceil(max_model_len / page_size)
    page_bytes = (kv_per_token + draft_kv_bytes_per_token) * page_size
    if settings.num_pages is not None:
        num_pages, sizing = settings.num_pages, "num_pages as set"
    elif settings.kv_cache_memory is not None:
        num_pages = settings.kv_cache_memory // page_bytes
        sizing = f"kv_cache_memory={settings.kv_cache_memory / GIB:.3f} GiB per replica, as set"
    else:
        if device_memory is None:
            device_memory = query_device_memory(math.prod(settings.mesh_shape))
        if device_memory.total is None:
            num_pages, sizing = _default_pool(settings, device_memory.platform, page_bytes, max_pages_per_seq)
        else:
            num_pages, sizing = _device_pool(cfg, settings, device_memory, itemsize, param_bytes, page_bytes)
            if (num_pages - RESERVED_PAGES) * page_size < max_model_len:
                raise ConfigError(
                    f"the KV cache would hold {(num_pages - RESERVED_PAGES) * page_size} tokens ({sizing}), fewer "
                    f"than one sequence of max_model_len={max_model_len}: raise gpu_memory_utilization, lower "
                    "max_model_len, or spread the model over more devices (tensor_parallel_size)"
                )
    if num_pages <= RESERVED_PAGES:
        raise ConfigError(
            f"the KV cache would hold {num_pages} page(s) of {page_size} tokens; at least 2 are needed "
            "(page 0 is reserved): raise num_pages or kv_cache_memory"
        )
    return MemoryPlan(
        param_bytes,
        kv_per_token,
        page_size,
        int(num_pages),
        max_model_len,
        max_pages_per_seq,
        dtype=jnp.dtype(dtype).name,
        quantization=settings.quantization,
        quantization_group_size=resolved_group_size(
            cfg, settings.quantization, settings.quantization_group_size, settings.mesh_shape[1]
        ),
        quantize_lm_head=settings.quantize_lm_head and settings.quantization in ("int8", "int4"),
        has_experts=cfg.is_moe,
        activation_quantization=settings.activation_quantization,
        kv_cache_dtype=settings.kv_cache_dtype,
        kv_bytes_per_token_model_dtype=cfg.kv_bytes_per_token(itemsize),
        draft_kv_bytes_per_token=draft_kv_bytes_per_token,
        num_layers=cfg.num_layers,
        num_sliding_layers=cfg.num_sliding_layers,
        sliding_window=cfg.sliding_window,
        num_replicas=settings.mesh_shape[0],
        sizing=sizing,
        lora_bytes=lora_bytes,
        host_kv_bytes=int(settings.kv_offloading_size * GIB) if settings.kv_offloading_size else 0,
    )


def _default_pool(settings: EngineConfig, platform: str, page_bytes: int, max_pages_per_seq: int) -> tuple[int, str]:
    """The fixed pool: DEFAULT_KV_CACHE_MEMORY, no more than every sequence slot at max_model_len needs."""
    pages = DEFAULT_KV_CACHE_MEMORY // page_bytes
    cap = settings.max_num_seqs * max_pages_per_seq + RESERVED_PAGES
    capped = f", capped at max_num_seqs x max_model_len ({cap} pages)" if cap < pages else ""
    if platform == "cpu":
        why = "the CPU default; gpu_memory_utilization applies to accelerators only and is ignored here"
    else:
        why = (
            f"the fixed default: the {platform}'s allocator reports no memory figures (memory_stats() has no "
            "bytes_limit, e.g. under XLA_PYTHON_CLIENT_ALLOCATOR=platform), so gpu_memory_utilization "
            "cannot be applied"
        )
        logger.warning("KV cache: %s; set kv_cache_memory or num_pages to size it", why)
    return min(pages, cap), (
        f"{DEFAULT_KV_CACHE_MEMORY / GIB:g} GiB per replica{capped} ({why}; kv_cache_memory or num_pages sets it)"
    )


def _device_pool(
    cfg: ModelConfig, settings: EngineConfig, device: DeviceMemory, itemsize: int, param_bytes: int, page_bytes: int
) -> tuple[int, str]:
    """Pages per replica from gpu_memory_utilization x device memory - bytes in use - reserve, per device.

    A replica's pages are split over its model axis when that divides the KV heads (else every device
    of the replica holds them all). The weights count as the larger of what the allocator has in use
    and their per-device share (a figure read before loading still leaves room for them); a
    speculative draft model, loaded after this plan, is added. Across hosts (num_processes > 1) every
    process must allocate the same pages, so the weights' share stands in for the measured use."""
    assert device.total is not None
    tp = settings.mesh_shape[1]
    shards = tp if cfg.num_kv_heads % tp == 0 else 1
    weights = param_bytes // tp
    draft = 0
    if settings.speculation == "draft":
        draft = ModelConfig.from_dir(settings.speculative_model).param_bytes(itemsize) // tp
    elif settings.speculation == "eagle3":  # replicated on every device
        from jaxserve.loading.eagle3_checkpoint import head_param_count

        draft = head_param_count(settings.speculative_model) * itemsize
    in_use = device.in_use if settings.num_processes == 1 else 0
    used = max(in_use, weights) + draft
    utilization = settings.gpu_memory_utilization
    allowed = int(utilization * device.total)
    cap = ""
    if device.limit is not None and device.limit < allowed - 2**20:  # not just rounding: a smaller pool
        cap = (
            f", capped at JAX's allocator pool of {device.limit / GIB:.2f} GiB ({device.limit / device.total:.2f} "
            "of the device: XLA_PYTHON_CLIENT_MEM_FRACTION)"
        )
    if device.limit is not None:
        allowed = min(allowed, device.limit)
    reserve = activation_reserve(cfg, settings, itemsize)
    budget = allowed - used - reserve
    speculator = "EAGLE-3 head" if settings.speculation == "eagle3" else "draft"
    weights_text = "weights" + (f" + {speculator}" if draft else "")
    formula = (
        f"{utilization:g} x {device.total / GIB:.2f} GiB of {device.platform} memory{cap} - "
        f"{used / GIB:.2f} GiB in use ({weights_text}) - {reserve / GIB:.2f} GiB reserve (activations, "
        f"XLA workspaces)"
    )
    if budget < page_bytes // shards * (RESERVED_PAGES + 1):
        raise ConfigError(
            f"no device memory is left for the KV cache: {formula} = {budget / GIB:.2f} GiB per device. Raise "
            "gpu_memory_utilization, spread the model over more devices (tensor_parallel_size), quantize the "
            "weights (quantization=int8), or set kv_cache_memory"
        )
    return budget * shards // page_bytes, f"{formula} = {budget / GIB:.2f} GiB per device"
