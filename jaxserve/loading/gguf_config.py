"""A GGUF file's model metadata as the Hugging Face config.json the rest of jaxserve reads.

GGUF keys are `{arch}.{name}` (llama.cpp's `gguf-py/gguf/constants.py` `Keys`); this module maps those
of the architectures jaxserve serves onto transformers' config fields. What llama.cpp does not store
but hard-codes per architecture (Gemma 3's local RoPE base and its 5:1 local/global layer pattern,
Qwen3-MoE's renormalised top-k) is filled in the same way llama.cpp fills it, so that a file means
what llama.cpp makes of it.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxserve.errors import UnsupportedModelError

# GGUF architecture -> HF model_type (before the expert / sliding-window refinements below).
_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "gemma3": "gemma3_text",
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(_MODEL_TYPES)

# Gemma 3 facts llama.cpp hard-codes rather than reads (src/llama-model.cpp, LLM_ARCH_GEMMA3).
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0
_GEMMA3_SLIDING_PATTERN = 6  # every 6th layer global


def gguf_architecture(metadata: Mapping[str, Any]) -> str:
    arch = metadata.get("general.architecture")
    if arch not in _MODEL_TYPES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return arch


def hf_config(metadata: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """config.json for the model in the file; `tensor_names` tells whether the LM head is tied (a file
    without `output.weight` reuses the token embedding, as llama.cpp does)."""
    arch = gguf_architecture(metadata)

    def get(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    def need(name: str) -> Any:
        value = get(name)
        if value is None:
            raise UnsupportedModelError(f"the GGUF file lacks {arch}.{name}, which a {arch} model needs")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    vocab = int(get("vocab_size") or len(tokens))
    if not vocab:
        raise UnsupportedModelError("the GGUF file gives no vocabulary size (no vocab_size, no token list)")
    cfg: dict[str, Any] = {
        "model_type": _MODEL_TYPES[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length") or get("expert_feed_forward_length") or 0),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "max_position_embeddings": int(get("context_length") or 2048),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6 if arch != "llama" else 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10_000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
    }
    for key, meta in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if metadata.get(f"tokenizer.ggml.{meta}") is not None:
            cfg[key] = int(metadata[f"tokenizer.ggml.{meta}"])
    scaling = _rope_scaling(get)
    if scaling:
        cfg["rope_scaling"] = scaling
    window = get("attention.sliding_window")
    if arch in ("llama", "mistral"):
        experts = int(get("expert_count") or 0)
        if experts:  # Mixtral is written as llama with experts
            cfg.update(
                model_type="mixtral", num_local_experts=experts, num_experts_per_tok=int(need("expert_used_count"))
            )
        elif window:
            cfg["model_type"] = "mistral"
        if window:  # Mistral's window survives only where the converter wrote it
            cfg["sliding_window"] = int(window)
    elif arch == "qwen2":
        cfg["attention_bias"] = True
    elif arch == "qwen3moe":
        cfg.update(
            num_experts=int(need("expert_count")),
            num_experts_per_tok=int(need("expert_used_count")),
            moe_intermediate_size=int(need("expert_feed_forward_length")),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    elif arch == "gemma3":
        cfg.update(_gemma3_fields(get, cfg))
    return cfg


def _gemma3_fields(get, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's extras. llama.cpp scales queries by 1/sqrt(hidden / heads) for the 27B model (62
    layers) and by 1/sqrt(head_dim) otherwise, which is what each checkpoint's query_pre_attn_scalar says."""
    layers = cfg["num_hidden_layers"]
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if layers == 62 else cfg["head_dim"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(get("attention.sliding_window") or 4096),
        "sliding_window_pattern": _GEMMA3_SLIDING_PATTERN,
        "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _rope_scaling(get) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(get("rope.scaling.factor") or 1.0)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        original = get("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported (linear, yarn)")
