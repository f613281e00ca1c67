"""Turn settings into a ready model: config, dtype, and params (from safetensors or seeded dummy weights)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.loading import converted_weights
from jaxserve.model import quant
from jaxserve.loading.checkpoint import checkpoint_dtype, load_hf_params
from jaxserve.loading.int4_checkpoint import read_int4_format
from jaxserve.loading.kv_scales import log_kv_scales, read_kv_scales
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.config.engine_config import FP8_KV_CACHE_DTYPES
from jaxserve.config.model_config import check_group_fits, default_group_size
from jaxserve.errors import ConfigError, ModelLoadError
from jaxserve.model.weights import Params, init_dummy_params, unstack_layers
from jaxserve.loading.orbax_checkpoint import abstract_params, is_orbax_checkpoint, read_manifest, restore_params
from jaxserve.model.sharding import MODEL, Shardings, make_shardings


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    params: Params
    dtype: Any  # jnp dtype of params, activations and the KV cache
    model_dir: str
    shardings: Shardings
    group_size: int | None = None  # input rows per quantization scale (quantization_group_size, resolved)
    # An fp8 KV cache's scales from the checkpoint (k, v), f32[L, K] each (loading/kv_scales.py); None: 1.0
    kv_scales: tuple[np.ndarray, np.ndarray] | None = None


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
    An AWQ / GPTQ checkpoint's 4-bit layers load into int4 as stored (loading/int4_checkpoint.py;
    the engine sets quantization="int4" for them, `implied_quantization`).
    """
    model_dir = resolve_model_dir(settings)
    cfg = ModelConfig.from_dir(model_dir)
    if settings.runner == "pooling":  # embeddings read no head: a causal LM's lm_head is skipped, a base model has none
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    int4_format = read_int4_format(model_dir) if settings.load_format in ("auto", "safetensors") else None
    if int4_format is not None and int4_format.group_size is not None and settings.quantization == "int4":
        if settings.quantization_group_size not in (None, int4_format.group_size):
            raise ConfigError(
                f"{model_dir} is an {int4_format.describe()} checkpoint: quantization_group_size "
                f"{settings.quantization_group_size} would requantize it; leave it unset"
            )
        settings = settings.replace(quantization_group_size=int4_format.group_size)  # the checkpoint's groups
    if settings.quantization in ("int8", "int4") and settings.quantization_group_size is None:
        w8a8 = settings.activation_quantization == "int8"  # per-channel weight scales (quant._w8a8_matmul)
        group = 0 if w8a8 else default_group_size(cfg, settings.quantization, mesh.shape[MODEL])
        settings = settings.replace(quantization_group_size=group)
    elif settings.quantization in ("int8", "int4"):
        check_group_fits(cfg, settings.quantization, settings.quantization_group_size, mesh.shape[MODEL])
    moe = settings.moe_parallelism
    act_order = int4_format is not None and int4_format.act_order and settings.quantization == "int4"
    shardings = make_shardings(
        cfg,
        mesh,
        stacked,
        settings.quantization,
        settings.quantize_lm_head,
        moe,
        act_order,
        settings.quantization_group_size,
    )
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
        checkpoint_quantization = read_manifest(model_dir).get("quantization", "none")
        params = load_orbax_params(
            model_dir,
            cfg,
            dtype,
            mesh,
            shardings if checkpoint_quantization != "none" else float_shardings,
            stacked,
            settings.quantization,
            settings.quantize_lm_head,
            moe,
            settings.quantization_group_size,
        )
        # An int8 checkpoint is restored as int8: nothing left to quantize.
        quantized &= checkpoint_quantization == "none"
    else:  # safetensors, or a GGUF file behind the directory: int8 quantized tensor by tensor as read
        convert = lambda: load_hf_params(  # noqa: E731
            model_dir,
            cfg,
            dtype,
            shardings.params,
            stacked,
            settings.quantization,
            settings.quantize_lm_head,
            settings.quantization_group_size,
        )
        if converted_weights.enabled(model_dir):  # converted (or laid-out) weights kept between starts
            parts = dict(cfg=cfg, dtype=dtype, stacked=stacked, quantization=settings.quantization)
            parts.update(lm_head=settings.quantize_lm_head, group_size=settings.quantization_group_size)
            narrow = converted_weights.stored_dtype(model_dir, dtype) if not quantized else None
            params = converted_weights.load_or_convert(model_dir, parts, shardings.params, convert, narrow)
        else:
            params = convert()
        quantized = False
    if quantized:
        params = quant.quantize_params_placed(
            params, shardings.params, settings.quantize_lm_head, settings.quantization, settings.quantization_group_size
        )
    kv_scales = None
    if settings.kv_cache_dtype in FP8_KV_CACHE_DTYPES:  # vLLM reads them for an fp8 cache only
        kv_scales = read_kv_scales(model_dir, cfg) if fmt == "safetensors" else None
        log_kv_scales(settings.kv_cache_dtype, kv_scales)
    return LoadedModel(
        cfg=cfg,
        params=params,
        dtype=dtype,
        model_dir=model_dir,
        shardings=shardings,
        group_size=settings.quantization_group_size,
        kv_scales=kv_scales,
    )


def load_orbax_params(
    model_dir: str,
    cfg: ModelConfig,
    dtype: Any,
    mesh: Mesh,
    shardings: Shardings,
    stacked: bool,
    quantization: str = "none",
    quantize_lm_head: bool = False,
    moe_parallelism: str = "tensor",
    group_size: int | None = None,
) -> Params:
    """Restore a jaxserve orbax checkpoint straight onto the mesh, cast to `dtype` by orbax.

    An int8 checkpoint (manifest quantization="int8") needs the same `quantization` and
    `quantize_lm_head` settings and group size (the manifest's `quantization_group_size`), and
    `shardings` of the int8 layout; its int8 values and f32 scales are restored as saved."""
    if not is_orbax_checkpoint(model_dir):
        raise ModelLoadError(f"{model_dir} is not a jaxserve orbax checkpoint (no jaxserve_checkpoint.json)")
    manifest = read_manifest(model_dir)
    stored = manifest.get("quantization", "none")
    stored_head = bool(manifest.get("quantize_lm_head", False))
    if stored != "none" and (stored != quantization or stored_head != quantize_lm_head):
        raise ModelLoadError(
            f"{model_dir} holds {stored}-quantized params (quantize_lm_head={stored_head}); "
            f"load it with quantization={stored!r}, quantize_lm_head={stored_head}"
        )
    if stored != "none":
        stored_group = manifest.get("quantization_group_size")
        if stored_group is None:
            raise ModelLoadError(
                f"{model_dir} holds int8 params with one scale per output channel in an older "
                "layout; quantize the model again with scripts/quantize.py"
            )
        if stored_group != quant.quantization_group_size(stored, group_size):
            raise ModelLoadError(
                f"{model_dir} holds {stored} params in groups of {stored_group} input rows; "
                f"load it with quantization_group_size={stored_group}"
            )
        group_size = stored_group
    stacked_shardings = (
        shardings.params
        if stacked
        else make_shardings(cfg, mesh, True, stored, quantize_lm_head, moe_parallelism, group_size=group_size).params
    )
    params = restore_params(
        model_dir, abstract_params(cfg, dtype, stacked_shardings, stored, quantize_lm_head, group_size)
    )
    if stacked:
        return params
    # Slicing a stacked weight on its replicated layer axis keeps each device's own shard.
    return jax.jit(unstack_layers, out_shardings=shardings.params)(params)
