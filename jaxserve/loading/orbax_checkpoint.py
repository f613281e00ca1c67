"""jaxserve's own checkpoint format: an orbax checkpoint of the params pytree beside a HF config.json.

A directory holds `config.json` (Hugging Face format, so tools can read the shape), the tokenizer,
`params/` (orbax, layers stacked on a leading axis) and `jaxserve_checkpoint.json`, a manifest
with the layout version of the params pytree. The loader refuses any other version, so a later
change of the pytree (e.g. quantized leaves) can never be misread as this one. Restoring goes
straight onto the target shardings in the requested dtype: no full copy on one device first.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import serialization

from jaxserve.model import quant
from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.model.weights import Params, param_specs

MANIFEST = "jaxserve_checkpoint.json"
PARAMS_DIR = "params"
FORMAT = "jaxserve-orbax"
LAYOUT_VERSION = 1  # Params with stacked LayerParams, linear weights [in, out]


def is_orbax_checkpoint(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, MANIFEST))


def read_manifest(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: cannot read the checkpoint manifest ({err})") from None
    if manifest.get("format") != FORMAT:
        raise ModelLoadError(f"{path}: not a {FORMAT} checkpoint (format={manifest.get('format')!r})")
    version = manifest.get("layout_version")
    if version != LAYOUT_VERSION:
        raise ModelLoadError(
            f"{model_dir}: params layout version {version!r}, but this jaxserve reads version {LAYOUT_VERSION}; "
            "re-create the checkpoint with this version (scripts/convert_hf_to_orbax.py)"
        )
    return manifest


def _stacked(params: Params) -> Params:
    if isinstance(params.layers, tuple):
        return params.replace(layers=jax.tree.map(lambda *ws: jnp.stack(ws), *params.layers))
    return params


def save_params(model_dir: str, params: Params, **manifest_extra: Any) -> None:
    """Write `params/` and the manifest into `model_dir` (which should already hold config.json).

    Per-layer (tuple) params are stacked first. `manifest_extra` is recorded in the manifest
    (e.g. quantization="int8", stored_dtype)."""
    import orbax.checkpoint as ocp

    os.makedirs(model_dir, exist_ok=True)
    target = os.path.abspath(os.path.join(model_dir, PARAMS_DIR))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(target, _stacked(params), force=True)
    checkpointer.wait_until_finished()
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)})
    manifest = {
        "format": FORMAT,
        "layout_version": LAYOUT_VERSION,
        "quantization": "none",
        "stored_dtypes": dtypes,
        **manifest_extra,
    }
    with open(os.path.join(model_dir, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")


def abstract_params(
    cfg: ModelConfig,
    dtype: Any,
    shardings: Params | None,
    quantization: str = "none",
    quantize_lm_head: bool = False,
    group_size: int | None = None,
) -> Params:
    """The stacked params as ShapeDtypeStructs with their target shardings: what restore fills.

    quantization="int8" (a checkpoint saved with QuantArray leaves, manifest quantization="int8"):
    the linear weights are QuantArray(values i8, scales f32) and `shardings` is that layout's."""
    specs = param_specs(cfg)
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=lambda x: hasattr(x, "init"))
    if quantization == "int8":
        abstract = jax.eval_shape(lambda p: quant.quantize_params(p, quantize_lm_head, "int8", group_size), abstract)
    if shardings is None:
        return abstract
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, shardings)


def restore_params(model_dir: str, abstract: Any) -> Any:
    """Restore `params/` onto the shapes, dtypes and shardings of `abstract` (orbax casts the dtype)."""
    import orbax.checkpoint as ocp

    read_manifest(model_dir)
    source = os.path.abspath(os.path.join(model_dir, PARAMS_DIR))
    if not os.path.isdir(source):
        raise ModelLoadError(f"{model_dir}: the manifest is there but {PARAMS_DIR}/ is missing")
    checkpointer = ocp.StandardCheckpointer()
    try:
        # orbax records every field of the pytree, None ones too, and needs the target to name the same
        # fields; a checkpoint written before an optional field (e.g. Qwen3's q_norm) existed has no
        # entry for it, so fields that are None here and absent there are left out of the target.
        target = serialization.to_state_dict(abstract)
        stored = checkpointer.metadata(source).item_metadata.tree
        restored = checkpointer.restore(source, _without_absent_nones(target, stored))
    except (ValueError, KeyError, FileNotFoundError) as err:
        raise ModelLoadError(f"{model_dir}: the params do not match this config ({err})") from None
    return serialization.from_state_dict(abstract, _with_nones(restored, target))


def _without_absent_nones(target: Any, stored: Any) -> Any:
    """`target` (nested dicts) less the None entries whose key `stored` (the on-disk tree) lacks."""
    if not isinstance(target, dict) or not isinstance(stored, dict):
        return target
    return {k: _without_absent_nones(v, stored.get(k)) for k, v in target.items() if v is not None or k in stored}


def _with_nones(restored: Any, target: Any) -> Any:
    """`restored` with the None entries of `target` that `_without_absent_nones` left out put back."""
    if not isinstance(target, dict):
        return restored
    return {k: None if v is None else _with_nones(restored[k], v) for k, v in target.items()}
