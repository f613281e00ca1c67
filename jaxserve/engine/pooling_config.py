"""How a pooling engine turns a prompt's hidden states into its embedding: `PoolerConfig`.

Resolved once at start-up, in vLLM's order: `--pooler-config` (its spellings: `pooling_type` LAST /
MEAN / CLS, `normalize`, `dimensions`), over the model's sentence-transformers files when it has
them (`modules.json`, `1_Pooling/config.json`, a `Normalize` module), over the architecture's
default (Qwen3, as Qwen3-Embedding: the last token, normalized; others: the mean, normalized, as
vLLM normalizes embeddings by default). Matryoshka dimensions (a request's `dimensions`) come from
config.json's `is_matryoshka` / `matryoshka_dimensions`, or the pooler config's. Host only: no jax.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from jaxserve.errors import ConfigError

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling modes (new `pooling_mode` and legacy `pooling_mode_*` keys) -> ours
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_ST_LEGACY = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_KNOWN_KEYS = {"pooling_type", "normalize", "dimensions", "is_matryoshka", "matryoshka_dimensions"}


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """`pooling_type`: which hidden states make the embedding (LAST: the last token's, MEAN: the mean
    over the prompt's tokens, CLS: the first token's), each the final-normed state. `normalize`: to
    unit L2 norm (after a request's `dimensions` cut it, as sentence-transformers' truncate_dim).
    `dimensions`: the default output size (None: the hidden size). `matryoshka`: whether requests may
    ask for fewer dimensions, and `matryoshka_dimensions` which (None: any up to the hidden size)."""

    pooling_type: str = "MEAN"
    normalize: bool = True
    dimensions: int | None = None
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "default"  # where the pooling type came from (logged at start-up)

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ConfigError(f"pooling_type {self.pooling_type!r}: one of {', '.join(POOLING_TYPES)}")

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> int:
        """The output size of a request asking for `dimensions` (None: the default); ValueError names
        what the model cannot give."""
        if dimensions is None:
            return self.dimensions or hidden_size
        if dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {dimensions}")
        if dimensions == (self.dimensions or hidden_size):
            return dimensions
        if not self.matryoshka:
            raise ValueError(
                "this model does not support Matryoshka representations: dimensions must be left out "
                f"(or be {self.dimensions or hidden_size}); fewer dimensions would give poor embeddings"
            )
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(
                f"dimensions {dimensions} is not one this model was trained for: {list(self.matryoshka_dimensions)}"
            )
        if dimensions > hidden_size:
            raise ValueError(f"dimensions {dimensions} is more than the model's {hidden_size}")
        return dimensions


def parse_pooler_config(value: Any) -> dict | None:
    """`--pooler-config`: a JSON object (or a dict from YAML / Python), checked for known keys."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"pooler_config is not valid JSON: {err}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"pooler_config must be a JSON object, got {value!r}")
    unknown = set(value) - _KNOWN_KEYS
    if unknown:
        raise ConfigError(f"pooler_config: unknown keys {sorted(unknown)}; known: {sorted(_KNOWN_KEYS)}")
    out = dict(value)
    if "pooling_type" in out:
        kind = str(out["pooling_type"]).upper()
        if kind not in POOLING_TYPES:
            raise ConfigError(f"pooler_config pooling_type {out['pooling_type']!r}: one of {', '.join(POOLING_TYPES)}")
        out["pooling_type"] = kind
    return out


def sentence_transformers_pooling(model_dir: str) -> dict:
    """What a sentence-transformers model's files say: {'pooling_type', 'normalize', 'dimensions'}
    for those present ({} without modules.json). A pooling mode jaxserve does not serve is refused."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return {}
    with open(modules_path) as f:
        modules = json.load(f)
    out: dict[str, Any] = {"normalize": False}
    for module in modules:
        kind = str(module.get("type", ""))
        path = os.path.join(model_dir, module.get("path", ""))
        if kind.endswith("Normalize"):
            out["normalize"] = True
        elif kind.endswith("Pooling"):
            config_path = os.path.join(path, "config.json")
            if os.path.isfile(config_path):
                with open(config_path) as f:
                    out["pooling_type"] = _st_pooling_type(json.load(f), config_path)
        elif kind.endswith("Dense"):
            raise ConfigError(f"{model_dir}: a sentence-transformers Dense module ({module.get('path')}) is not served")
    return out


def _st_pooling_type(config: Mapping[str, Any], where: str) -> str:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [ours for key, ours in _ST_LEGACY.items() if config.get(key)]
        others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_LEGACY]
        if others or len(modes) > 1:
            raise ConfigError(f"{where}: pooling {sorted(others) or modes} is not served (LAST, MEAN or CLS)")
        return modes[0] if modes else "MEAN"
    if isinstance(mode, (list, tuple)):
        if len(mode) != 1:
            raise ConfigError(f"{where}: pooling over several modes {list(mode)} is not served")
        mode = mode[0]
    if mode not in _ST_MODES:
        raise ConfigError(f"{where}: pooling mode {mode!r} is not served (lasttoken, mean or cls)")
    return _ST_MODES[mode]


def architecture_default(architecture: str) -> str:
    """The pooling of a model with no sentence-transformers files: Qwen3 (Qwen3-Embedding) the last
    token, others the mean."""
    return "LAST" if architecture.startswith("Qwen3") else "MEAN"


def resolve_pooler_config(
    model_dir: str, hf_config: Mapping[str, Any], override: Mapping[str, Any] | None
) -> PoolerConfig:
    """The engine's PoolerConfig: `override` (--pooler-config) over the sentence-transformers files
    over the architecture's default."""
    arch = (hf_config.get("architectures") or [hf_config.get("model_type") or ""])[0]
    fields: dict[str, Any] = {
        "pooling_type": architecture_default(arch),
        "normalize": True,
        "source": f"{arch} default",
    }
    st = sentence_transformers_pooling(model_dir)
    if st:
        fields.update(st, source="sentence-transformers files")
    matryoshka_dims = hf_config.get("matryoshka_dimensions")
    fields["matryoshka"] = bool(hf_config.get("is_matryoshka") or matryoshka_dims)
    fields["matryoshka_dimensions"] = tuple(matryoshka_dims) if matryoshka_dims else None
    for key, value in (override or {}).items():
        if key == "is_matryoshka":
            fields["matryoshka"] = bool(value)
        elif key == "matryoshka_dimensions":
            fields["matryoshka_dimensions"] = tuple(int(d) for d in value) if value else None
            fields["matryoshka"] = fields["matryoshka"] or bool(value)
        else:
            fields[key] = value
    if override:
        fields["source"] = "--pooler-config" if "pooling_type" in override else fields["source"]
    if fields.get("dimensions") is not None:
        fields["dimensions"] = int(fields["dimensions"])
    fields["normalize"] = bool(fields["normalize"])
    return PoolerConfig(**fields)
