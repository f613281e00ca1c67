"""The K/V cache scales a checkpoint may give each attention layer, as vLLM reads them for an fp8 KV
cache (`--kv-cache-dtype fp8`): `model.layers.{i}.self_attn.k_scale` and `.v_scale` (llm-compressor and
ModelOpt checkpoints), the older `k_proj.output_scale` / `v_proj.output_scale`, and `kv_scale` (one
scale for both). Each is a scalar (vLLM's per-tensor scale) or one value per KV head; a stored float8
value times it is the real K or V (`model.kv_cache`). Read from the safetensors headers and the few
bytes of those scalars only; the weight loader (`checkpoint.load_hf_params`) skips these names, so a
checkpoint with them loads with any cache (vLLM ignores them unless the cache is fp8, and so do we)."""

from __future__ import annotations

import logging
import re

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.loading.checkpoint import KV_SCALE_NAMES, KV_SCALE_SUFFIXES, iter_safetensors, safetensors_files

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def read_kv_scales(model_dir: str, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray] | None:
    """(k, v) f32[L, K] from a safetensors checkpoint's scales, or None when it has none (the cache then
    uses 1.0, as vLLM does). A checkpoint that gives them for some layers only, or gives only K's or
    only V's, is refused: a missing scale read as 1.0 would silently mis-scale those layers."""
    from jaxserve.loading.gguf_model import gguf_source

    if gguf_source(model_dir) is not None:
        return None  # a GGUF file has no such scales
    L, K = cfg.num_layers, cfg.num_kv_heads
    found: dict[str, dict[int, np.ndarray]] = {"k": {}, "v": {}}
    for path in safetensors_files(model_dir):
        for name, tensor in _scale_tensors(path):
            match = _LAYER.search(name)
            layer, which = int(match.group(1)), KV_SCALE_NAMES[match.group(2)]
            value = np.asarray(tensor, np.float32).reshape(-1)
            if layer >= L or value.size not in (1, K):
                raise ModelLoadError(
                    f"{path}: {name} has {value.size} values for layer {layer}; expected 1 or "
                    f"{K} (one per KV head) in a model of {L} layers"
                )
            for key in ("k", "v") if which == "kv" else (which,):
                found[key][layer] = np.broadcast_to(value, (K,))
    if not found["k"] and not found["v"]:
        return None
    missing = {key: sorted(set(range(L)) - set(found[key])) for key in ("k", "v")}
    if any(missing.values()):
        raise ModelLoadError(
            f"{model_dir}: the checkpoint's KV cache scales are incomplete (layers without a "
            f"k_scale: {missing['k']}, without a v_scale: {missing['v']})"
        )
    k, v = (np.stack([found[key][i] for i in range(L)]).astype(np.float32) for key in ("k", "v"))
    if not (np.all(np.isfinite(k) & (k > 0)) and np.all(np.isfinite(v) & (v > 0))):
        raise ModelLoadError(f"{model_dir}: the checkpoint's KV cache scales must be positive and finite")
    return k, v


def _scale_tensors(path: str):
    """(name, tensor) of a file's KV cache scales; the other tensors are never read (memory-mapped views)."""
    for name, tensor in iter_safetensors(path):
        if name.endswith(KV_SCALE_SUFFIXES) and _LAYER.search(name):
            yield name, tensor


def log_kv_scales(kv_cache_dtype: str, scales: tuple[np.ndarray, np.ndarray] | None) -> None:
    """The start-up line vLLM also prints: which scales an fp8 cache uses."""
    if scales is None:
        logger.info(
            "%s KV cache: scales 1.0 (the checkpoint gives no k_scale / v_scale); values beyond the "
            "format's range saturate",
            kv_cache_dtype,
        )
    else:
        k, v = scales
        logger.info(
            "%s KV cache: the checkpoint's scales, k_scale %.4g..%.4g, v_scale %.4g..%.4g over %d layers",
            kv_cache_dtype,
            k.min(),
            k.max(),
            v.min(),
            v.max(),
            k.shape[0],
        )
