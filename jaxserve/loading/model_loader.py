"""Turn settings into a ready model: config, dtype, and params (from safetensors or seeded dummy weights)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.model import quant
from jaxserve.loading.checkpoint import checkpoint_dtype, load_hf_params
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.model.weights import Params, init_dummy_params, unstack_layers
from jaxserve.loading.orbax_checkpoint import abstract_params, is_orbax_checkpoint, read_manifest, restore_params
from jaxserve.model.sharding import Shardings, make_shardings


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    params: Params
    dtype: Any  # jnp dtype of params, activations and the KV cache
    model_dir: str
    shardings: Shardings


def resolve_model_dir(settings: EngineConfig) -> str:
    if settings.model is None:
        raise ModelLoadError("no model given: pass model=PATH (a Hugging Face model directory)")
    path = os.path.expanduser(settings.model)
    if not os.path.isdir(path):
        raise ModelLoadError(f"model directory {settings.model!r} does not exist")
    return path


def resolve_dtype(settings: EngineConfig, model_dir: str) -> Any:
    """auto: float32 on CPU (XLA converts bf16 weights to f32 before every CPU matmul, so bf16 decode
    measured 2.6x slower there), else the checkpoint's dtype, else bfloat16."""
    name = settings.dtype
    if name == "auto":
        name = "float32" if jax.default_backend() == "cpu" else (checkpoint_dtype(model_dir) or "bfloat16")
    return jnp.dtype(name)


def load_model(settings: EngineConfig, mesh: Mesh, stacked: bool = True) -> LoadedModel:
    """Read the config, derive the shardings on `mesh`, and put each weight straight onto its shards.

    stacked=False returns per-layer weight arrays, for the unrolled forward. quantization="int8"
    or "int4" quantizes a safetensors or GGUF checkpoint tensor by tensor (a GGUF file's Q4_0 / Q4_1
    linear weights go into int4 as they are) as it is read (never a float copy of
    the model on the host); a float orbax checkpoint after it is placed, one weight at a time
    (quant.quantize_params_placed); an int8 orbax one (scripts/quantize.py) restores as it was saved.
    """
    model_dir = resolve_model_dir(settings)
    cfg = ModelConfig.from_dir(model_dir)
    moe = settings.moe_parallelism
    shardings = make_shardings(cfg, mesh, stacked, settings.quantization, settings.quantize_lm_head, moe)
    quantized = settings.quantization in ("int8", "int4")
    float_shardings = make_shardings(cfg, mesh, stacked, moe_parallelism=moe) if quantized else shardings
    dtype = resolve_dtype(settings, model_dir)
    fmt = settings.load_format
    if fmt == "auto":
        fmt = "orbax" if is_orbax_checkpoint(model_dir) else "safetensors"
    if fmt == "dummy":
        def init(cfg, seed, dtype):
            params = init_dummy_params(cfg, seed, dtype)
            return params if stacked else unstack_layers(params)

        init = jax.jit(init, static_argnums=(0, 1, 2), out_shardings=float_shardings.params)
        params = init(cfg, settings.seed, dtype)
    elif fmt == "orbax":
        stored = read_manifest(model_dir).get("quantization", "none")
        params = load_orbax_params(model_dir, cfg, dtype, mesh, shardings if stored != "none" else float_shardings,
                                   stacked, settings.quantization, settings.quantize_lm_head, moe)
        quantized &= stored == "none"  # an int8 checkpoint is restored as int8: nothing left to quantize
    else:  # safetensors, or a GGUF file behind the directory: int8 quantized tensor by tensor as read
        params = load_hf_params(model_dir, cfg, dtype, shardings.params, stacked, settings.quantization,
                                settings.quantize_lm_head)
        quantized = False
    if quantized:
        params = quant.quantize_params_placed(params, shardings.params, settings.quantize_lm_head,
                                              settings.quantization)
    return LoadedModel(cfg=cfg, params=params, dtype=dtype, model_dir=model_dir, shardings=shardings)


def load_orbax_params(model_dir: str, cfg: ModelConfig, dtype: Any, mesh: Mesh, shardings: Shardings,
                      stacked: bool, quantization: str = "none", quantize_lm_head: bool = False,
                      moe_parallelism: str = "tensor") -> Params:
    """Restore a jaxserve orbax checkpoint straight onto the mesh, cast to `dtype` by orbax.

    An int8 checkpoint (manifest quantization="int8") needs the same `quantization` and
    `quantize_lm_head` settings, and `shardings` of the int8 layout; its int8 values and f32 scales
    are restored as saved."""
    if not is_orbax_checkpoint(model_dir):
        raise ModelLoadError(f"{model_dir} is not a jaxserve orbax checkpoint (no jaxserve_checkpoint.json)")
    manifest = read_manifest(model_dir)
    stored = manifest.get("quantization", "none")
    stored_head = bool(manifest.get("quantize_lm_head", False))
    if stored != "none" and (stored != quantization or stored_head != quantize_lm_head):
        raise ModelLoadError(f"{model_dir} holds {stored}-quantized params (quantize_lm_head={stored_head}); "
                             f"load it with quantization={stored!r}, quantize_lm_head={stored_head}")
    stacked_shardings = shardings.params if stacked else make_shardings(
        cfg, mesh, True, stored, quantize_lm_head, moe_parallelism).params
    params = restore_params(model_dir, abstract_params(cfg, dtype, stacked_shardings, stored, quantize_lm_head))
    if stacked:
        return params
    # Slicing a stacked weight on its replicated layer axis keeps each device's own shard.
    return jax.jit(unstack_layers, out_shardings=shardings.params)(params)
