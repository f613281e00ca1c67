"""A PEFT LoRA directory read into numpy, in jaxserve's [in, out] orientation, checked against the base model.

Host only (numpy, json; no jax), so the engine can read an adapter on a worker thread. Whatever the
engine cannot run exactly as PEFT would (DoRA, biases, embeddings, lm_head, MoE experts, ranks above
--max-lora-rank, shapes of another model) is refused here with a LoRAError naming the problem and the
path, never half-loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import LoRAError
from jaxserve.lora.request import LORA_MODULES, PEFT_NAMES

# PEFT / transformers module name -> (its block in a decoder layer, jaxserve's key)
_PEFT_MODULES = {name: ("self_attn" if key in ("q", "k", "v", "o") else "mlp", key) for key, name in PEFT_NAMES.items()}
_MLP = ("gate_proj", "up_proj", "down_proj")
_SEVEN = " ".join(PEFT_NAMES.values())
# `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (PEFT's save_pretrained), also without
# the PeftModel prefix, with the adapter's name (`.lora_A.default.weight`), and under a multimodal
# model's text tower (`model.language_model.layers...`). `module` is the name PEFT's patterns match.
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?"
    r"(?P<module>(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<block>\w+)\.(?P<proj>\w+))"
    r"\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)
# Config options whose adapters compute something other than x @ A @ B added to a linear layer's output.
_UNSUPPORTED_OPTIONS = {
    "layer_replication": "it repeats base-model layers",
    "target_parameters": "it adapts raw parameters (such as fused MoE experts), not linear layers",
    "trainable_token_indices": "it retrains rows of the embedding table",
    "alora_invocation_tokens": "activated LoRA switches on mid-sequence",
}
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


@dataclasses.dataclass(frozen=True, eq=False)
class PeftAdapter:
    """One LoRA adapter on the host, ready to be written into a device slot.

    modules[m] = (A f32[L, in, rank], B f32[L, rank, out]) for each targeted module m of LORA_MODULES:
    A = lora_A.weight.T and B = lora_B.weight.T * that module's scaling, so the update of a layer's
    output is x @ A[l] @ B[l]. Layers the adapter leaves alone hold zeros, and a module of a smaller
    rank (rank_pattern) has zero columns of A and rows of B past its own rank: both change nothing.

    `scaling` is the adapter's lora_alpha / r (or / sqrt(r) with use_rslora); it is already folded
    into B, per module where rank_pattern or alpha_pattern give a module its own."""

    rank: int  # the largest rank of any module: the padded width of every A and B
    scaling: float
    modules: dict[str, tuple[np.ndarray, np.ndarray]]
    path: str
    target_modules: tuple[str, ...]  # the keys of `modules`, in LORA_MODULES order

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def lora_module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each adaptable module's (in, out): the base weight's [in, out] shape in jaxserve's params."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    nh, kh = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": (d, nh), "k": (d, kh), "v": (d, kh), "o": (nh, d), "gate": (d, f), "up": (d, f), "down": (f, d)}


def served_module_dims(cfg: ModelConfig, targets: tuple[str, ...] = ()) -> dict[str, tuple[int, int]]:
    """The modules the engine keeps adapter slots for: `targets` (lora_target_modules), else all seven,
    or a mixture of experts' attention only (its experts are not adaptable)."""
    dims = lora_module_dims(cfg)
    if cfg.is_moe:
        experts = sorted(set(targets) & {"gate", "up", "down"})
        if experts:
            raise LoRAError(
                f"lora_target_modules: {', '.join(experts)} of a mixture of experts cannot be adapted "
                "(its MLP is experts); choose among q_proj k_proj v_proj o_proj"
            )
        dims = {m: d for m, d in dims.items() if m in ("q", "k", "v", "o")}
    return {m: d for m, d in dims.items() if not targets or m in targets}


def lora_stack_bytes(cfg: ModelConfig, slots: int, rank: int, itemsize: int, targets: tuple[str, ...] = ()) -> int:
    """Device bytes of `slots` resident adapters of rank `rank` over the served modules (`runner.lora`):
    what every decode step reads beside the base weights."""
    dims = served_module_dims(cfg, targets)
    return cfg.num_layers * slots * rank * itemsize * sum(i + o for i, o in dims.values())


def load_peft_adapter(path: str, cfg: ModelConfig, *, max_rank: int, served: tuple[str, ...] = ()) -> PeftAdapter:
    """Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) for the base model
    `cfg`; LoRAError for anything jaxserve cannot serve exactly (see the module docstring), or for a
    module outside `served` (lora_target_modules; () = all)."""
    conf = _read_config(path)
    _check_options(conf, path, cfg)
    tensors = _read_tensors(path)
    pairs = _pair_tensors(tensors, path, cfg)
    ranks = {key: int(_pattern_value(conf.get("rank_pattern"), key, conf["r"])) for key in pairs}
    rank = max(ranks.values())
    if rank > max_rank:
        worst = max(ranks, key=ranks.get)
        raise LoRAError(
            f"{path}: adapter rank {rank} ({worst}) is above --max-lora-rank {max_rank}; "
            f"start the server with --max-lora-rank {rank} or more to serve it"
        )
    dims = lora_module_dims(cfg)
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key, (ours, layer, a_name, b_name) in sorted(pairs.items()):
        d_in, d_out = dims[ours]
        r = ranks[key]
        lora_a = _checked(tensors, a_name, (r, d_in), path)  # [r, in]
        lora_b = _checked(tensors, b_name, (d_out, r), path)  # [out, r]
        alpha = float(_pattern_value(conf.get("alpha_pattern"), key, conf["lora_alpha"]))
        if ours not in modules:
            modules[ours] = (
                np.zeros((cfg.num_layers, d_in, rank), np.float32),
                np.zeros((cfg.num_layers, rank, d_out), np.float32),
            )
        a, b = modules[ours]
        a[layer, :, :r] = lora_a.T
        b[layer, :r, :] = lora_b.T * _scaling(alpha, r, conf)
    outside = [m for m in LORA_MODULES if m in modules and served and m not in served]
    if outside:
        raise LoRAError(
            f"{path}: the adapter targets {', '.join(PEFT_NAMES[m] for m in outside)}; this engine "
            f"adapts {', '.join(PEFT_NAMES[m] for m in served)} only (--lora-target-modules)"
        )
    return PeftAdapter(
        rank=rank,
        scaling=_scaling(float(conf["lora_alpha"]), int(conf["r"]), conf),
        modules={m: modules[m] for m in LORA_MODULES if m in modules},
        path=path,
        target_modules=tuple(m for m in LORA_MODULES if m in modules),
    )


def _scaling(alpha: float, r: int, conf: Mapping[str, Any]) -> float:
    return alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r


def _read_config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter directory {path} does not exist (or is not a directory)")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise LoRAError(f"{path} has no adapter_config.json: not a PEFT adapter directory")
    try:
        with open(config_path, encoding="utf-8") as f:
            conf = json.load(f)
    except (OSError, ValueError) as err:
        raise LoRAError(f"{config_path} cannot be read as JSON: {err}") from None
    if not isinstance(conf, dict):
        raise LoRAError(f"{config_path} is not a JSON object")
    return conf


def _check_options(conf: Mapping[str, Any], path: str, cfg: ModelConfig) -> None:
    """Refuse, from adapter_config.json alone, what would not compute x @ A @ B on the seven modules."""
    peft_type = conf.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"{path}: peft_type {peft_type!r} is not LORA; jaxserve serves LoRA adapters only")
    r, alpha = conf.get("r"), conf.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise LoRAError(
            f"{path}: adapter_config.json needs a positive integer r and a number lora_alpha, "
            f"got r={r!r}, lora_alpha={alpha!r}"
        )
    if conf.get("use_dora"):
        raise LoRAError(
            f"{path}: DoRA adapters (use_dora: true) are not supported; serve a plain LoRA, "
            "or merge the DoRA adapter into the base model"
        )
    if conf.get("fan_in_fan_out"):
        raise LoRAError(f"{path}: fan_in_fan_out: true (GPT-2's Conv1D layers) does not fit jaxserve's models")
    if conf.get("bias", "none") != "none":
        raise LoRAError(
            f'{path}: bias {conf["bias"]!r} is not supported (only bias: "none"): the adapter '
            "retrains the base model's biases"
        )
    if conf.get("lora_bias"):
        raise LoRAError(f"{path}: lora_bias: true (a bias on lora_B) is not supported")
    if conf.get("modules_to_save"):
        raise LoRAError(
            f"{path}: modules_to_save {list(conf['modules_to_save'])} is not supported: the "
            "adapter replaces whole modules of the base model, which jaxserve cannot swap per request"
        )
    for option, why in _UNSUPPORTED_OPTIONS.items():
        if conf.get(option):
            raise LoRAError(f"{path}: {option} is not supported ({why})")
    for pattern in ("rank_pattern", "alpha_pattern"):
        value = conf.get(pattern) or {}
        if not isinstance(value, dict) or not all(isinstance(v, (int, float)) for v in value.values()):
            raise LoRAError(f"{path}: {pattern} must map module patterns to numbers, got {value!r}")
    targets = _config_targets(conf.get("target_modules"), path, cfg)
    mlp = sorted(targets & set(_MLP))
    if mlp and cfg.is_moe:
        raise LoRAError(_moe_message(path, cfg, mlp))


def _config_targets(target_modules: Any, path: str, cfg: ModelConfig) -> set[str]:
    """The PEFT module names that `target_modules` selects among the seven, refusing any other.

    A list selects the modules whose name ends with an entry (PEFT's rule); a string is a regular
    expression over full module names, except "all-linear" (every linear layer but lm_head: the
    tensors present then say which). None: PEFT's default for the architecture, saved as tensors too."""
    if target_modules is None or target_modules == "all-linear":
        return set()
    if isinstance(target_modules, str):
        probes = {
            f"model.layers.{i}.{block}.{name}": name
            for i in range(cfg.num_layers)
            for name, (block, _) in _PEFT_MODULES.items()
        }
        others = [n for n in ("lm_head", "model.embed_tokens", "model.norm") if re.fullmatch(target_modules, n)]
        if others:
            raise LoRAError(
                f"{path}: target_modules {target_modules!r} also selects {', '.join(others)}; "
                f"jaxserve adapts only {_SEVEN}"
            )
        return {name for probe, name in probes.items() if re.fullmatch(target_modules, probe)}
    names = {str(entry).rsplit(".", 1)[-1]: str(entry) for entry in target_modules}
    others = sorted(entry for name, entry in names.items() if name not in _PEFT_MODULES)
    if others:
        raise LoRAError(
            f"{path}: target_modules {others} are not supported; jaxserve adapts only {_SEVEN} "
            "(not the embeddings, lm_head or other layers)"
        )
    return set(names)


def _moe_message(path: str, cfg: ModelConfig, mlp: list[str]) -> str:
    return (
        f"{path}: the adapter targets the MLP ({', '.join(mlp)}) of a mixture-of-experts model "
        f"({cfg.architecture}, {cfg.num_experts} experts); jaxserve adapts only the attention "
        "(q_proj k_proj v_proj o_proj) of MoE models"
    )


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise LoRAError(
                f"{path} holds only adapter_model.bin (a pickle, which jaxserve does not load: unpickling "
                "executes code); convert it to safetensors once with PEFT: "
                "PeftModel.from_pretrained(base, dir).save_pretrained(dir, safe_serialization=True)"
            )
        raise LoRAError(f"{path} has no adapter_model.safetensors")
    return _read_safetensors(weights)


def _read_safetensors(file: str) -> dict[str, np.ndarray]:
    """name -> array of a (small) safetensors file: jaxserve reads the format itself, as its checkpoint
    loader does, so the safetensors package stays a test dependency."""
    with open(file, "rb") as f:
        data = f.read()
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_len])
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise LoRAError(f"{file}: tensor {name} has dtype {info['dtype']}, not a float type")
            dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
            start, end = info["data_offsets"]
            out[name] = np.frombuffer(data, dtype, (end - start) // dtype.itemsize, 8 + header_len + start).reshape(
                info["shape"]
            )
        return out
    except (struct.error, ValueError, KeyError, TypeError) as err:
        raise LoRAError(f"{file} is not a valid safetensors file ({err})") from None


def _pair_tensors(
    tensors: Mapping[str, np.ndarray], path: str, cfg: ModelConfig
) -> dict[str, tuple[str, int, str, str]]:
    """module name (as PEFT's patterns see it) -> (jaxserve key, layer, lora_A name, lora_B name)."""
    found: dict[str, dict[str, str]] = {}
    where: dict[str, tuple[str, int]] = {}
    for name in tensors:
        m = _TENSOR_NAME.match(name)
        proj = m and m["proj"]
        if m is None or proj not in _PEFT_MODULES or _PEFT_MODULES[proj][0] != m["block"]:
            if cfg.is_moe and (".mlp." in name or "block_sparse_moe" in name):
                raise LoRAError(_moe_message(path, cfg, [name]))
            raise LoRAError(
                f"{path}: tensor {name} adapts a module jaxserve cannot; it adapts only the "
                f"decoder layers' {_SEVEN} (not the embeddings, lm_head or other layers)"
            )
        if proj in _MLP and cfg.is_moe:
            raise LoRAError(_moe_message(path, cfg, [name]))
        layer = int(m["layer"])
        if layer >= cfg.num_layers:
            raise LoRAError(
                f"{path}: tensor {name} is for layer {layer}, but the base model has "
                f"{cfg.num_layers} layers (0..{cfg.num_layers - 1})"
            )
        sides = found.setdefault(m["module"], {})
        if m["ab"] in sides:
            raise LoRAError(f"{path}: lora_{m['ab']} of {m['module']} is stored twice ({sides[m['ab']]}, {name})")
        sides[m["ab"]] = name
        where[m["module"]] = (_PEFT_MODULES[proj][1], layer)
    pairs = {}
    for module, sides in found.items():
        if len(sides) < 2:
            ((have, name),) = sides.items()
            raise LoRAError(f"{path}: tensor {name} has no lora_{'B' if have == 'A' else 'A'} beside it")
        pairs[module] = (*where[module], sides["A"], sides["B"])
    if not pairs:
        raise LoRAError(f"{path}: adapter_model.safetensors holds no lora_A / lora_B tensors")
    return pairs


def _pattern_value(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern that matches the end of the
    module's name (at a dot), as peft.utils.other.get_pattern_key does."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _checked(tensors: Mapping[str, np.ndarray], name: str, shape: tuple[int, int], path: str) -> np.ndarray:
    tensor = tensors[name]
    if tensor.shape != shape:
        raise LoRAError(
            f"{path}: tensor {name} has shape {list(tensor.shape)}, but the base model and the "
            f"adapter's rank need {list(shape)}: was the adapter trained on another model?"
        )
    return tensor.astype(np.float32)
