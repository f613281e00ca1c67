"""The fields of a Hugging Face config.json that vary by model family: the architecture a
`model_type` names, Gemma 3's text defaults and layers, Qwen's sliding window, q/k norms, experts,
and RoPE scaling (linear, dynamic, Llama 3, YaRN). `ModelConfig.from_hf_dict` reads the rest."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from jaxserve.errors import UnsupportedModelError


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling; `kind` is "linear", "llama3" (Llama-3.1) or "yarn" (Qwen3's
    long-context checkpoints: frequencies interpolated by `factor` outside the band of dimensions
    between beta_fast and beta_slow rotations, and cos/sin times `attention_factor`)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # yarn: resolved from factor / mscale / mscale_all_dim as transformers does
    truncate: bool = True  # yarn: the correction band's bounds rounded to whole dimensions


def arch_from_model_type(model_type: str | None) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
        "gemma3": "Gemma3ForConditionalGeneration",
    }.get(model_type or "", f"unknown model_type {model_type!r}")


# Gemma3TextConfig's defaults (transformers 4.50, which the Gemma 3 checkpoints were written for: their
# config.json gives only what differs, e.g. Gemma-3-12B's text_config names 7 keys).
GEMMA3_TEXT_DEFAULTS: Mapping[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "attention_bias": False,
}


def family_fields(arch: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields past the Llama family's: q/k norms, Gemma 3's layers, experts."""
    if arch == "Qwen3ForCausalLM":
        return {"qk_norm": True}
    if arch.startswith("Gemma3"):
        if hf.get("attn_logit_softcapping"):  # Gemma 2's; HF's Gemma 3 attention does not apply it either
            raise UnsupportedModelError("Gemma with attention logit soft-capping (Gemma 2) is not supported")
        if hf.get("use_bidirectional_attention"):  # EmbeddingGemma: an encoder, not a causal decoder
            raise UnsupportedModelError(
                "Gemma 3 with use_bidirectional_attention=True (an embedding model) is not supported"
            )
        num_layers = int(hf["num_hidden_layers"])
        layer_types = hf.get("layer_types")
        if not layer_types:
            pattern = int(hf.get("sliding_window_pattern") or 6)  # every pattern-th layer is global
            layer_types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
            ]
        if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
            raise UnsupportedModelError(
                f"layer_types must name {num_layers} layers 'sliding_attention' or "
                f"'full_attention', got {layer_types!r}"
            )
        rope = hf.get("rope_parameters") or {}
        local = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), Mapping) else {}
        local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(
                f"Gemma 3 local layers with rope_type {local['rope_type']!r} are not "
                "supported (only the default RoPE there)"
            )
        cap = hf.get("final_logit_softcapping")
        return {
            "qk_norm": True,
            "hidden_act": hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh"),
            "layer_types": tuple(layer_types),
            "rope_local_theta": float(local_theta),
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or hf["head_dim"]),
            "scale_embeddings": True,
            "sandwich_norms": True,
            "norm_weight_offset": 1.0,
            "final_logit_softcapping": float(cap) if cap else None,
        }
    if arch == "Qwen3MoeForCausalLM":
        num_layers, step = int(hf["num_hidden_layers"]), int(hf.get("decoder_sparse_step") or 1)
        only = {int(i) for i in hf.get("mlp_only_layers") or ()}
        dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)
        # transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts; the published configs num_experts
        experts = hf.get("num_experts") or hf["num_local_experts"]
        return {
            "qk_norm": True,
            "num_experts": int(experts),
            "num_experts_per_tok": int(hf["num_experts_per_tok"]),
            "moe_intermediate_size": int(hf["moe_intermediate_size"]),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "dense_layers": dense,
        }
    # Every layer's MLP is experts of intermediate_size, top-k renormalised; router_jitter_noise acts in
    # training only (HF's router adds it only when training).
    if arch == "MixtralForCausalLM":
        return {
            "num_experts": int(hf["num_local_experts"]),
            "num_experts_per_tok": int(hf["num_experts_per_tok"]),
            "moe_intermediate_size": int(hf["intermediate_size"]),
            "norm_topk_prob": True,
        }
    return {}


def qwen_sliding_window(hf: Mapping[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """Qwen2 / Qwen3's `use_sliding_window`: the layers from `max_window_layers` on attend to only
    the last `sliding_window` keys (transformers' `layer_types`). Returns (window, layer types):
    (None, ()) when no layer is windowed, (window, ()) when every layer is."""
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window") or not window:
        return None, ()
    num_layers = int(hf["num_hidden_layers"])
    first = int(hf.get("max_window_layers") if hf.get("max_window_layers") is not None else num_layers)
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
    ]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(
            f"layer_types must name {num_layers} layers 'sliding_attention' or 'full_attention', got {types!r}"
        )
    if "sliding_attention" not in types:
        return None, ()
    return int(window), (() if "full_attention" not in types else tuple(types))


def rope_scaling(scaling: Mapping[str, Any] | None, hf: Mapping[str, Any] | None = None) -> RopeScaling | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    if kind == "yarn":
        return yarn_scaling(scaling, hf or {})
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (supported: linear, llama3, yarn)")


def yarn_scaling(scaling: Mapping[str, Any], hf: Mapping[str, Any]) -> RopeScaling:
    """transformers' defaults: the pretraining length from the config's top level or else
    max_position_embeddings; factor = max_position_embeddings / that length when unset; beta_fast 32
    and beta_slow 1 when unset (or 0); attention_factor from mscale / mscale_all_dim, else
    0.1 ln(factor) + 1."""
    max_pos = int(hf.get("max_position_embeddings", 2048))
    original = int(
        hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") or max_pos
    )
    factor = float(scaling.get("factor") or max_pos / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling(
        "yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        attention_factor=float(attention),
        truncate=bool(scaling.get("truncate", True)),
    )
