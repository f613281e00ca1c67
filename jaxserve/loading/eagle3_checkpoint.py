"""EAGLE-3 heads in the speculators format (vLLM's format for trained speculators): load and save.

A head directory holds config.json (`speculators_model_type: "eagle3"`, the head's decoder layer as
`transformer_layer_config`, `draft_vocab_size`, `norm_before_residual`, `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids`, `speculators_config`) and safetensors: `fc`, `layers.0.*` (q/k/v
of input width 2D, `hidden_norm`, `input_layernorm`, `post_attention_layernorm`, the MLP), `norm`,
`lm_head` over the draft vocabulary, `d2t` (target id minus draft id, per draft id), `t2d` (which
target ids the draft vocabulary holds) and, optionally, `embed_tokens` (else the target's is
shared). Heads saved by the original EAGLE-3 code (`midlayer.*`, a flat Llama config with
`draft_vocab_size`) load too. What jaxserve cannot compute exactly is refused by name rather than run
approximately.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError, ModelLoadError
from jaxserve.loading.checkpoint import iter_safetensors, safetensors_files, write_safetensors

SPECULATORS_VERSION = "0.9.0"  # the format version written into the configs we save
# Options of speculators' Eagle3 config that change the forward: refused when set, since the head
# would run without them.
_REFUSED_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output", "use_fc_norm", "embed_requires_grad_norm")

_LAYER_NAMES = {  # checkpoint name (after `layers.0.` / `midlayer.`) -> (field, transposed)
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "hidden_norm.weight": ("hidden_norm", False),
}


def is_eagle3_dir(path: str) -> bool:
    """Whether `path` holds an EAGLE-3 head (either format), by its config."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return False
    return hf.get("speculators_model_type") == "eagle3" or any("Eagle3" in a for a in hf.get("architectures") or [])


def read_config(path: str, target: ModelConfig):
    """The head's `Eagle3Config` from its config.json, checked against the target it drafts for."""
    from jaxserve.model.eagle3 import Eagle3Config, default_aux_layers

    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            hf = json.load(f)
    except OSError:
        raise ModelLoadError(f"{path!r} has no config.json: an EAGLE-3 head directory needs one") from None
    except ValueError as err:
        raise ModelLoadError(f"{config_path}: not valid JSON ({err})") from None
    if hf.get("speculators_model_type") not in (None, "eagle3"):
        raise ConfigError(
            f"{path}: speculators_model_type {hf['speculators_model_type']!r} is not supported "
            "(method 'eagle3' loads EAGLE-3 heads)"
        )
    for option in _REFUSED_OPTIONS:
        if hf.get(option):
            raise ConfigError(f"{path}: the head sets {option}, which jaxserve's EAGLE-3 head does not implement")
    _check_proposal_method(path, hf.get("speculators_config") or {})
    layer_hf = dict(hf.get("transformer_layer_config") or hf)
    layers = int(layer_hf.get("num_hidden_layers", 1))
    if layers != 1:
        raise ConfigError(f"{path}: a head of {layers} decoder layers; jaxserve serves EAGLE-3 heads of one layer")
    if not layer_hf.get("architectures") or any("Eagle" in a for a in layer_hf["architectures"]):
        layer_hf["architectures"] = ["LlamaForCausalLM"]  # the head's one layer is a Llama layer
    layer_hf.setdefault("vocab_size", target.vocab_size)
    try:
        layer = ModelConfig.from_hf_dict(layer_hf)
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{config_path}: cannot read the head's layer config ({err!r})") from None
    if layer.vocab_size != target.vocab_size:
        raise ConfigError(
            f"{path}: the head drafts over a vocabulary of {layer.vocab_size} tokens, the model has "
            f"{target.vocab_size}: an EAGLE-3 head must be trained for this model"
        )
    target_hidden = int(hf.get("target_hidden_size") or layer.hidden_size)
    if target_hidden != target.hidden_size:
        raise ConfigError(
            f"{path}: the head reads target states of width {target_hidden}, the model's are "
            f"{target.hidden_size}: it was trained for another model"
        )
    aux = hf.get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(int(i) for i in aux) if aux else default_aux_layers(target.num_layers)
    bad = [i for i in aux if not 0 <= i < target.num_layers]
    if bad or len(set(aux)) != len(aux):
        raise ConfigError(
            f"{path}: aux hidden-state layers {list(aux)} do not fit a model of {target.num_layers} layers"
        )
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=int(hf.get("draft_vocab_size") or layer.vocab_size),
        target_hidden_size=target_hidden,
        aux_layers=aux,
        norm_before_residual=bool(hf.get("norm_before_residual", False)),
    )


def _check_proposal_method(path: str, spec: dict) -> None:
    """Refuse heads trained for a proposal method other than a greedy chain (trees, ...)."""
    methods = spec.get("proposal_methods") or []
    default = spec.get("default_proposal_method")
    chosen = [m for m in methods if m.get("proposal_type") == default] or methods[:1]
    for method in chosen:
        kind = method.get("proposal_type", "greedy")
        if kind != "greedy":
            raise ConfigError(f"{path}: proposal method {kind!r} is not supported (jaxserve drafts a greedy chain)")


def head_param_count(path: str) -> int:
    """The head's parameters (its weights' elements, the vocabulary maps excluded), read from its
    safetensors headers: what the memory plan counts before the head is loaded."""
    return sum(
        array.size
        for file in safetensors_files(path)
        for name, array in iter_safetensors(file)
        if name not in ("d2t", "t2d")
    )


def load_eagle3(path: str, target: ModelConfig, dtype: Any):
    """(Eagle3Config, Eagle3Params as numpy arrays in `dtype`) of the head in `path`."""
    from jaxserve.model.eagle3 import Eagle3Params
    from jaxserve.model.weights import LayerParams

    cfg = read_config(path, target)
    tensors: dict[str, np.ndarray] = {}
    for file in safetensors_files(path):
        for name, array in iter_safetensors(file):
            tensors[_plain_name(name)] = array
    layer: dict[str, np.ndarray] = {}
    for name, (field, transposed) in _LAYER_NAMES.items():
        array = _take(tensors, path, name)
        layer[field] = _cast(array.T if transposed else array, dtype)
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    Vd = cfg.draft_vocab_size
    draft_ids = np.arange(Vd, dtype=np.int64)
    to_target = draft_ids if d2t is None else draft_ids + np.asarray(d2t, np.int64).reshape(-1)[:Vd]
    if to_target.shape != (Vd,) or to_target.min() < 0 or to_target.max() >= target.vocab_size:
        raise ModelLoadError(f"{path}: d2t maps draft ids outside the model's vocabulary of {target.vocab_size}")
    embed = tensors.pop("embed_tokens.weight", None)
    hidden_norm = layer.pop("hidden_norm")
    params = Eagle3Params(
        fc=_cast(_take(tensors, path, "fc.weight").T, dtype),
        hidden_norm=hidden_norm,
        layer=LayerParams(**layer),
        norm=_cast(_take(tensors, path, "norm.weight"), dtype),
        lm_head=_cast(_take(tensors, path, "lm_head.weight").T, dtype),
        draft_to_target=to_target.astype(np.int32),
        embed=None if embed is None else _cast(embed, dtype),
    )
    _check_shapes(path, cfg, params)
    return cfg, params


def _plain_name(name: str) -> str:
    for prefix in ("model.",):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


def _take(tensors: dict[str, np.ndarray], path: str, name: str) -> np.ndarray:
    key = name if name in ("fc.weight", "norm.weight", "lm_head.weight") else f"layers.0.{name}"
    if key not in tensors:
        raise ModelLoadError(f"{path}: the head has no tensor {key!r}")
    return tensors.pop(key)


def _cast(array: np.ndarray, dtype: Any) -> np.ndarray:
    return np.asarray(array).astype(np.dtype(dtype))


def _check_shapes(path: str, cfg, params) -> None:
    D, Dt, lc = cfg.hidden_size, cfg.target_hidden_size, cfg.layer
    want = {
        "fc": (params.fc, (len(cfg.aux_layers) * Dt, D)),
        "q_proj": (params.layer.wq, (2 * D, lc.num_heads * lc.head_dim)),
        "k_proj": (params.layer.wk, (2 * D, lc.num_kv_heads * lc.head_dim)),
        "lm_head": (params.lm_head, (D, cfg.draft_vocab_size)),
    }
    for name, (array, shape) in want.items():
        if tuple(array.shape) != shape:
            raise ModelLoadError(f"{path}: {name} has shape {tuple(array.shape)}, the config implies {shape}")
    if params.embed is not None and params.embed.shape != (lc.vocab_size, D):
        raise ModelLoadError(f"{path}: embed_tokens has shape {params.embed.shape}, expected {(lc.vocab_size, D)}")


def save_eagle3(
    path: str,
    cfg,
    params,
    *,
    target_name: str,
    target_architecture: str = "LlamaForCausalLM",
    dtype: str = "bfloat16",
    include_embed: bool = False,
    num_speculative_tokens: int = 3,
) -> None:
    """Write a head in the speculators format (config.json + model.safetensors) that `load_eagle3`
    and vLLM read; `target_name` names the model it drafts for (the verifier)."""
    os.makedirs(path, exist_ok=True)
    store = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)

    def host(x, transposed=False):
        x = np.asarray(x, np.float32)
        return (x.T if transposed else x).astype(store)

    tensors = {"fc.weight": host(params.fc, True)}
    fields = {field: name for name, (field, _) in _LAYER_NAMES.items()}
    layer = {f.name: getattr(params.layer, f.name) for f in dataclasses.fields(params.layer)}
    layer["hidden_norm"] = params.hidden_norm
    for field, name in fields.items():
        tensors[f"layers.0.{name}"] = host(layer[field], _LAYER_NAMES[name][1])
    tensors["norm.weight"] = host(params.norm)
    tensors["lm_head.weight"] = host(params.lm_head, True)
    to_target = np.asarray(params.draft_to_target, np.int64)
    tensors["d2t"] = to_target - np.arange(len(to_target), dtype=np.int64)
    t2d = np.zeros(cfg.layer.vocab_size, bool)
    t2d[to_target] = True
    tensors["t2d"] = t2d
    if include_embed and params.embed is not None:
        tensors["embed_tokens.weight"] = host(params.embed)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(_config_json(cfg, target_name, target_architecture, dtype, num_speculative_tokens), f, indent=2)


def _config_json(cfg, target_name: str, target_architecture: str, dtype: str, k: int) -> dict:
    lc = cfg.layer
    layer = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": lc.hidden_size,
        "intermediate_size": lc.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": lc.num_heads,
        "num_key_value_heads": lc.num_kv_heads,
        "head_dim": lc.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": lc.rms_norm_eps,
        "rope_theta": lc.rope_theta,
        "max_position_embeddings": lc.max_position_embeddings,
        "vocab_size": lc.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name, "architectures": [target_architecture]},
        },
        "torch_dtype": dtype,
    }
