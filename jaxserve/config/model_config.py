"""ModelConfig: a decoder's shape and options, read from a Hugging Face config.json (and the
architectures jaxserve serves or plans). Hashable, so it is a static argument of `jax.jit`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable, Mapping

from jaxserve.config.engine_config import FP8_KV_CACHE_DTYPES
from jaxserve.config.hf_fields import (
    GEMMA3_TEXT_DEFAULTS,
    RopeScaling,
    arch_from_model_type,
    family_fields,
    qwen_sliding_window,
    rope_scaling,
)
from jaxserve.errors import ConfigError, ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",  # Gemma 3: its text tower
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
# Architectures whose config jaxserve reads and plans (`jaxserve plan`) but cannot serve (empty: every one it
# plans, it serves); the planner and its errors keep the distinction for a family read before its layers exist.
PLAN_ONLY_ARCHITECTURES: tuple[str, ...] = ()
PLANNABLE_ARCHITECTURES = SUPPORTED_ARCHITECTURES + PLAN_ONLY_ARCHITECTURES


# Bare base models (saved without a head: embedding checkpoints such as Qwen3-Embedding's Qwen3Model)
# -> the causal LM whose layer stack they are; loading/checkpoint.py reads their unprefixed tensors.
BASE_MODELS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Qwen3-MoE, Mixtral); hashable,
    so it is a static jit argument. The fields after `eos_token_ids` default to what the Llama family
    has, so its configs are unchanged by them."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, and Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    sliding_window: int | None = None  # Mistral: a query sees only the last `sliding_window` keys
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm (weight of head_dim) over each head's q and k before RoPE
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) | gelu_pytorch_tanh (Gemma's GeGLU)
    # Gemma 3: per layer "sliding_attention" (local, `sliding_window` keys) or "full_attention" (global);
    # () = every layer alike (all windowed when sliding_window is set, as Mistral).
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3); None = rope_theta
    query_pre_attn_scalar: float | None = None  # Gemma 3: scores scaled by its ** -0.5, not head_dim's
    scale_embeddings: bool = False  # Gemma: the input embedding times sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 3: RMSNorms after attention and after the MLP too (4 per layer)
    norm_weight_offset: float = 0.0  # Gemma: RMSNorm multiplies by (offset + weight), offset 1
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 3 if configured)
    # Mixture of experts (Qwen3-MoE, Mixtral): num_experts > 0 replaces the MLP of every layer not in
    # `dense_layers` by `num_experts` SwiGLU experts of `moe_intermediate_size` and a router [D, E];
    # each token runs its top `num_experts_per_tok`, weighted by the softmax renormalised over them
    # when norm_topk_prob (Mixtral always), else by the softmax over all experts.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()  # Qwen3-MoE mlp_only_layers / decoder_sparse_step: dense MLP here

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )

    @property
    def servable(self) -> bool:
        """Whether jaxserve has a forward for this architecture and config (else it can only plan it)."""
        return self.architecture in SUPPORTED_ARCHITECTURES and not (self.is_moe and self.dense_layers)

    def check_servable(self) -> None:
        """Raise UnsupportedModelError for an architecture (or a config) jaxserve can plan but not run."""
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported for serving yet: jaxserve can plan it "
                f"(`jaxserve plan --model DIR`) but not run it; served: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if not self.servable:
            # The layers are one stack (scanned): a dense MLP in some and experts in others would need two
            # stacks or both MLPs' weights in every layer. No released Qwen3-MoE has dense layers.
            raise UnsupportedModelError(
                f"{self.architecture} with dense MLP layers among the expert layers (mlp_only_layers / "
                f"decoder_sparse_step: dense layers {list(self.dense_layers)}) is not supported for serving; "
                "jaxserve can plan it (`jaxserve plan --model DIR`)"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (0 for a dense model)."""
        return self.num_layers - len(self.dense_layers) if self.is_moe else 0

    @property
    def num_sliding_layers(self) -> int:
        """Layers that attend to only the last `sliding_window` keys."""
        if not self.sliding_window:
            return 0
        if not self.layer_types:
            return self.num_layers
        return sum(t == "sliding_attention" for t in self.layer_types)

    def expert_params(self) -> int:
        """Elements of one expert of one layer: gate, up [D, F_e] and down [F_e, D]."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def expected_experts_read(self, batch: float) -> float:
        """Distinct experts per MoE layer that a step of `batch` token rows reads: E · (1 − (1 − k/E)^B).

        This assumes uniform, independent routing (each row picks k of E experts with equal odds); real
        routers are skewed, which touches fewer distinct experts. Batch 1 reads exactly k; large batches
        read nearly all E. 0 for a dense model."""
        if not self.is_moe:
            return 0.0
        e, k = self.num_experts, self.num_experts_per_tok
        return float(k) if batch <= 1 else e * (1.0 - (1.0 - k / e) ** batch)

    def _attn_weights(self) -> int:
        return self.hidden_size * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)

    def _dense_mlp_layers(self) -> int:
        return len(self.dense_layers) if self.is_moe else self.num_layers

    def num_params(self) -> int:
        """Every parameter, all experts included (the text tower only for Gemma3ForConditionalGeneration)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        per_layer = self._attn_weights() + (4 if self.sandwich_norms else 2) * d
        if self.qkv_bias:
            per_layer += h * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            per_layer += d
        if self.qk_norm:
            per_layer += 2 * h
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        moe = self.num_moe_layers * (self.num_experts * self.expert_params() + d * self.num_experts)  # + router
        return self.num_layers * per_layer + self._dense_mlp_layers() * 3 * d * f + moe + embed + d

    def active_params(self) -> int:
        """Parameters one token reads: all but the experts it is not routed to (top-k of E per MoE layer).

        Counted as the published "active" figures count them: the embedding table whole (a token reads
        one row of it) and the router. Equals num_params() for a dense model."""
        unused = self.num_experts - self.num_experts_per_tok
        return self.num_params() - self.num_moe_layers * unused * self.expert_params()

    def kv_bytes_per_token(self, bytes_per_element: int, kv_cache_dtype: str = "auto") -> int:
        """2 (K and V) * b * head_dim * kv_heads * layers (see DESIGN.md).

        kv_cache_dtype="int8": one byte per element plus one f32 scale per (token, kv head, K or V); fp8:
        one byte per element (its scales are per layer, not per token: 8 bytes a layer in all)."""
        if kv_cache_dtype == "int8":
            return 2 * (self.head_dim + 4) * self.num_kv_heads * self.num_layers
        if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
            bytes_per_element = 1
        return 2 * bytes_per_element * self.head_dim * self.num_kv_heads * self.num_layers

    def linear_params(self) -> int:
        """Elements of the weights int8 quantization replaces (q/k/v/o, gate/up/down of the dense MLPs and
        of every expert; not lm_head, not the routers)."""
        d, f = self.hidden_size, self.intermediate_size
        return (
            self.num_layers * self._attn_weights()
            + self._dense_mlp_layers() * 3 * d * f
            + self.num_moe_layers * self.num_experts * self.expert_params()
        )

    def linear_out_channels(self) -> int:
        """Output channels of those weights: one f32 scale each when quantized."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        return (
            self.num_layers * (h * (self.num_heads + 2 * self.num_kv_heads) + d)
            + self._dense_mlp_layers() * (2 * f + d)
            + self.num_moe_layers * self.num_experts * (2 * self.moe_intermediate_size + d)
        )

    def expert_bytes(self, bytes_per_element: int, quantization: str = "none", group_size: int | None = None) -> int:
        """Bytes of one expert of one layer (int8: 1 byte per element + an f32 scale per output channel;
        int4: `int4_bytes` with groups of `group_size`, None: `default_group_size`)."""
        if quantization == "int8":
            return self.expert_params() + (2 * self.moe_intermediate_size + self.hidden_size) * 4
        if quantization == "int4":
            g = resolved_group_size(self, quantization, group_size)
            return int4_bytes(self.expert_params(), g)
        return self.expert_params() * bytes_per_element

    def expert_bytes_read(self, batch: float, bytes_per_element: int, quantization: str = "none") -> float:
        """Expert weight bytes a decode step of `batch` rows reads, all MoE layers together:
        layers · E·(1 − (1 − k/E)^B) · bytes per expert, under uniform routing (`expected_experts_read`)."""
        return (
            self.num_moe_layers * self.expected_experts_read(batch) * self.expert_bytes(bytes_per_element, quantization)
        )

    def param_bytes_read(
        self, batch: float, bytes_per_element: int, quantization: str = "none", quantize_lm_head: bool = False
    ) -> float:
        """Parameter bytes a decode step of `batch` rows reads: param_bytes less the experts no row is
        routed to (expected, uniform routing). Equals param_bytes for a dense model."""
        all_experts = self.num_moe_layers * self.num_experts * self.expert_bytes(bytes_per_element, quantization)
        return (
            self.param_bytes(bytes_per_element, quantization, quantize_lm_head)
            - all_experts
            + self.expert_bytes_read(batch, bytes_per_element, quantization)
        )

    def kv_bytes_per_sequence(self, context: int, bytes_per_element: int, kv_cache_dtype: str = "auto") -> int:
        """KV bytes one sequence of `context` tokens needs when each sliding layer keeps only its window
        (what a per-layer-group pool would hold; the engine's one pool gives every layer `context` tokens)."""
        per_layer = self.kv_bytes_per_token(bytes_per_element, kv_cache_dtype) // self.num_layers
        window = min(context, self.sliding_window or context)
        return per_layer * (self.num_sliding_layers * window + (self.num_layers - self.num_sliding_layers) * context)

    def param_bytes(
        self,
        bytes_per_element: int,
        quantization: str = "none",
        quantize_lm_head: bool = False,
        group_size: int | None = None,
    ) -> int:
        """Bytes of all parameters; with quantization="int8" the linear layers take 1 byte + an f32 scale
        per group of `group_size` inputs (0: per output channel; None: `default_group_size`; experts:
        always per channel); with
        "int4" all of them, experts included, half a byte + an f32 scale and bias per group;
        quantize_lm_head: the head too, or the tied embedding table (quantized as the head [D, V])."""
        total = self.num_params() * bytes_per_element
        head = self.vocab_size * self.hidden_size if quantize_lm_head else 0  # tied: the table, as the head
        experts = self.num_moe_layers * self.num_experts
        dense = self.linear_params() - experts * self.expert_params() + head
        g = resolved_group_size(self, quantization, group_size)
        if quantization == "int8":
            expert_channels = experts * (2 * self.moe_intermediate_size + self.hidden_size)
            dense_channels = self.linear_out_channels() - expert_channels + (self.vocab_size if head else 0)
            total -= (self.linear_params() + head) * (bytes_per_element - 1)
            total += ((dense // g) if g else dense_channels) * 4 + expert_channels * 4
        elif quantization == "int4":
            total -= dense * bytes_per_element - int4_bytes(dense, g)
            total -= experts * (self.expert_params() * bytes_per_element - int4_bytes(self.expert_params(), g))
        return total

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], plan_only: bool = False) -> "ModelConfig":
        """Translate a Hugging Face config.json; refuse what we do not implement rather than run it wrongly.

        plan_only=True (the planner) also accepts PLAN_ONLY_ARCHITECTURES and configs `check_servable`
        refuses (a Qwen3-MoE with dense layers); without it they raise UnsupportedModelError."""
        archs = hf.get("architectures") or [arch_from_model_type(hf.get("model_type"))]
        arch = BASE_MODELS.get(archs[0], archs[0])  # a bare base model (embeddings) is its causal LM's stack
        if arch not in PLANNABLE_ARCHITECTURES:
            planned = (
                f" (planned only, not served yet: {', '.join(PLAN_ONLY_ARCHITECTURES)})"
                if (PLAN_ONLY_ARCHITECTURES)
                else ""
            )
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}{planned}"
            )
        outer = hf
        if arch.startswith("Gemma3"):  # the text tower; the checkpoints leave Gemma3TextConfig's defaults out
            hf = {**GEMMA3_TEXT_DEFAULTS, **(hf["text_config"] if "text_config" in hf else hf)}
        extra = family_fields(arch, hf)
        act = extra.get("hidden_act", hf.get("hidden_act", "silu"))
        if act not in ("silu", "gelu_pytorch_tanh") and arch in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"hidden_act {act!r} is not supported (only 'silu' / SwiGLU and 'gelu_pytorch_tanh' / GeGLU)"
            )
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope = dict(hf.get("rope_parameters") or {})  # transformers >= 5 keeps theta and scaling here
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if isinstance(rope.get("full_attention"), Mapping):  # transformers >= 5, per layer type (Gemma 3)
            rope = dict(rope["full_attention"])
            rope_theta = float(rope.get("rope_theta", rope_theta))
            scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        is_qwen = arch == "Qwen2ForCausalLM"
        sliding_window = hf.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            sliding_window, layer_types = qwen_sliding_window(hf)
            if layer_types:
                extra = {**extra, "layer_types": layer_types}
        eos = outer.get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        cfg = cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6 if is_qwen or arch.startswith("Qwen3") else 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling(scaling, hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen or bool(hf.get("attention_bias", False)),
            o_bias=(not is_qwen) and bool(hf.get("attention_bias", False)),
            sliding_window=int(sliding_window) if sliding_window else None,
            architecture=arch,
            bos_token_id=outer.get("bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            **extra,
        )
        if not plan_only:
            cfg.check_servable()
        return cfg

    @classmethod
    def from_dir(cls, path: str, plan_only: bool = False) -> "ModelConfig":
        config_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise ModelLoadError(f"model directory {path!r} does not exist")
        if not os.path.isfile(config_path):
            raise ModelLoadError(f"{path!r} has no config.json; a Hugging Face model directory needs one")
        with open(config_path, encoding="utf-8") as f:
            try:
                return cls.from_hf_dict(json.load(f), plan_only=plan_only)
            except (KeyError, TypeError, ValueError) as err:
                if isinstance(err, UnsupportedModelError):
                    raise
                raise ModelLoadError(f"{config_path}: cannot read the model config ({err!r})") from None


# Input rows per scale when quantization_group_size is not given (measured: docs/BENCHMARKS.md, issue 40).
INT8_GROUP_SIZE = 32
INT4_GROUP_SIZE = 32  # GGUF's Q4_0 / Q4_1 block: their files load into it exactly


def quantization_group_size(quantization: str, group_size: int | None) -> int:
    """The group size `quantization` uses: `group_size` when given (int8: 0 or -1 = one scale per output
    channel), else the method's default."""
    if quantization == "int4":
        if group_size is not None and group_size <= 0:
            raise ConfigError(f"int4 needs a positive quantization group size, not {group_size}")
        return INT4_GROUP_SIZE if group_size is None else group_size
    return INT8_GROUP_SIZE if group_size is None else max(group_size, 0)


def default_group_size(cfg: "ModelConfig", quantization: str, model_parallel: int = 1) -> int:
    """The group size a model gets when quantization_group_size is not given: the method's default if it
    divides the input rows of every quantized weight on each device (row-parallel weights, o_proj and
    down_proj, hold 1 / model_parallel of theirs), else the largest of 32 and 16 that does (int8: else
    one scale per output channel). An explicit group size that does not divide is refused instead."""
    return group_size_fitting(quantization, _quantized_rows(cfg, model_parallel, quantization).values())


def resolved_group_size(cfg: "ModelConfig", quantization: str, group_size: int | None, model_parallel: int = 1) -> int:
    """`group_size` as `quantization` reads it (quantization_group_size), or, when None, the model's
    default on a model axis of `model_parallel` devices (default_group_size)."""
    if group_size is None:
        return default_group_size(cfg, quantization, model_parallel)
    return quantization_group_size(quantization, group_size)


def group_size_fitting(quantization: str, rows: Iterable[int]) -> int:
    """The method's default group size if it divides every one of `rows`, else the largest of 32 and 16
    that does; else (int8) one scale per output channel, 0."""
    rows = list(rows)
    preferred = quantization_group_size(quantization, None)
    for g in (preferred, 32, 16):
        if g <= preferred and all(r % g == 0 for r in rows):
            return g
    return 0 if quantization == "int8" else preferred


def check_group_fits(cfg: "ModelConfig", quantization: str, group_size: int, model_parallel: int = 1) -> None:
    """Refuse a group size that does not divide some quantized weight's input rows on each device."""
    bad = _undivided_rows(cfg, group_size, model_parallel, quantization) if group_size > 0 else {}
    if bad:
        where = ", ".join(f"{name} ({rows} rows per device)" for name, rows in bad.items())
        raise ConfigError(
            f"quantization_group_size {group_size} does not divide the input rows of {where}; "
            f"choose a divisor such as {default_group_size(cfg, quantization, model_parallel)}"
            + (" or 0 (a scale per output channel)" if quantization == "int8" else "")
        )


def _undivided_rows(
    cfg: "ModelConfig", group_size: int, model_parallel: int, quantization: str = "int8"
) -> dict[str, int]:
    rows = _quantized_rows(cfg, model_parallel, quantization)
    return {name: r for name, r in rows.items() if r % group_size}


def _quantized_rows(cfg: "ModelConfig", model_parallel: int, quantization: str) -> dict[str, int]:
    """Input rows on each device of the weights a group size must divide, by the name an error gives."""
    rows = {"the hidden size": cfg.hidden_size, "o_proj": cfg.num_heads * cfg.head_dim // model_parallel}
    if cfg.intermediate_size:
        rows["down_proj"] = cfg.intermediate_size // model_parallel
    if quantization == "int4" and cfg.num_experts:  # int8 experts take a scale per channel, int4 groups
        rows["the experts' down_proj"] = cfg.moe_intermediate_size // model_parallel
    return rows


def int4_bytes(elements: int, group_size: int = INT4_GROUP_SIZE) -> int:
    """Bytes of `elements` weights in quant.Int4Array: half a byte each, an f32 scale and bias per group."""
    return elements // 2 + elements // group_size * 8
