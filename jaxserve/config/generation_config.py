"""The model's own sampling defaults: `generation_config.json` values for requests that leave them unset.

A checkpoint's creator states how it should be sampled (Qwen2.5: temperature 0.7, top_p 0.8, top_k 20;
the shipped default model: `do_sample: false`, i.e. greedy). Like vLLM, jaxserve makes these the
defaults of every request that does not set the field itself; a request's explicit value always wins.

Settings (spelled as vLLM spells them):
  generation_config           "auto": the model directory's generation_config.json (built-in defaults
                              when it has none); "vllm": ignore the file, use jaxserve's built-in
                              defaults (SamplingParams'); or a DIR holding a generation_config.json.
  override_generation_config  a JSON object merged over the loaded values, e.g. '{"temperature": 0.5}'.

What is read: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens (-> max_tokens),
the `config_key`s of `jaxserve.sampling.fields`, range-checked as SamplingParams checks them; and
`do_sample`. Where jaxserve goes beyond vLLM (which ignores `do_sample`): `do_sample: false` means
greedy, as in transformers, so the defaults get temperature 0 (unless the override sets a temperature
itself). The file's values are taken as written, not diffed against transformers' GenerationConfig defaults.

`max_tokens` from `max_new_tokens` follows vLLM for defaults: chat completions default to
min(max_new_tokens, what is left of the context); /v1/completions to min(16, max_new_tokens), its
OpenAI default being 16. Unlike vLLM, a request's explicit max_tokens is not capped by it.

No jax here: the server's start-up check and the settings parser import this module.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Mapping

from jaxserve.errors import ConfigError
from jaxserve.sampling.fields import FIELDS, SamplingField

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> the SamplingParams field it sets (the table's `config_key`s)
_CONFIG_FIELDS: dict[str, SamplingField] = {f.config_key: f for f in FIELDS if f.config_key is not None}
SAMPLING_KEYS = {key: f.name for key, f in _CONFIG_FIELDS.items()}
OVERRIDE_KEYS = (*SAMPLING_KEYS, "do_sample")


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    return float(value)


def _integer(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    return int(value)


def _check(key: str, value: Any) -> Any:
    """One value, type- and range-checked the way SamplingParams will check it (so start-up fails, not requests)."""
    if key == "do_sample":
        if not isinstance(value, bool):
            raise ConfigError(f"do_sample must be true or false, got {value!r}")
        return value
    field = _CONFIG_FIELDS[key]
    v = _integer(key, value) if field.type is int else _number(key, value)  # the file may write 20.0 for 20
    if not field.valid(v):
        raise ConfigError(f"{key} out of range: {value!r}")
    return v


def parse_override(value: Any) -> str | None:
    """Setting parser of override_generation_config: a dict or a JSON object string -> canonical JSON (or None).

    Stored as a string because EngineConfig must stay hashable (it is a static jit argument). Unknown
    keys are refused by name, so a typo ("temprature") does not pass silently."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "null"):
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"expected a JSON object such as '{{\"temperature\": 0.5}}', got {text!r} ({err})"
            ) from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a JSON object such as '{{\"temperature\": 0.5}}', got {value!r}")
    unknown = sorted(set(value) - set(OVERRIDE_KEYS))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(OVERRIDE_KEYS)}")
    checked = {k: _check(k, v) for k, v in value.items() if v is not None}
    return json.dumps(checked, sort_keys=True) if checked else None


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """The defaults requests start from: SamplingParams field -> value, and where they came from."""

    values: Mapping[str, Any]  # e.g. {"temperature": 0.0, "max_tokens": 256}; absent = SamplingParams' own default
    source: str  # e.g. "checkpoints/small/generation_config.json", or "jaxserve's built-in defaults"

    def get(self, name: str, fallback: Any = None) -> Any:
        return self.values.get(name, fallback)

    def request_values(self) -> dict[str, Any]:
        """The values a request's unset sampling fields take (max_tokens apart: each endpoint has its own rule)."""
        return {k: v for k, v in self.values.items() if k != "max_tokens"}

    def sampling_params(self, **explicit: Any):
        """SamplingParams of these defaults, explicit keywords winning (the offline API's default)."""
        from jaxserve.sampling.params import SamplingParams

        return SamplingParams(**{**self.values, **explicit})

    def describe(self) -> str:
        if not self.values:
            return f"default sampling parameters: {self.source} (temperature 1, no top-k/top-p/min-p limit)"
        shown = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(self.values.items()))
        return (
            f"default sampling parameters of requests that do not set them: {shown} (from {self.source}; "
            "--generation-config vllm ignores the model's file)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "values": dict(self.values)}


BUILT_IN = GenerationDefaults({}, "jaxserve's built-in defaults")


def read_generation_config(path: str) -> dict[str, Any]:
    """The sampling keys of one generation_config.json (other keys, e.g. eos_token_id, are not ours)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    values = {}
    for key in OVERRIDE_KEYS:
        if data.get(key) is not None:
            try:
                values[key] = _check(key, data[key])
            except ConfigError as err:
                raise ConfigError(f"{path}: {err}") from None
    return values


def resolve(file_values: Mapping[str, Any], override: Mapping[str, Any], source: str) -> GenerationDefaults:
    """Merge the override over the file, apply `do_sample`, and rename to SamplingParams fields."""
    merged = {**file_values, **override}
    if merged.get("do_sample") is False and "temperature" not in override:
        merged["temperature"] = 0.0  # transformers' greedy; the file's temperature (if any) does not apply
    values = {SAMPLING_KEYS[k]: v for k, v in merged.items() if k in SAMPLING_KEYS}
    if override:
        source = f"{source}, with override_generation_config {json.dumps(dict(override), sort_keys=True)}"
    return GenerationDefaults(values, source)


def load_generation_defaults(settings: Any, log: bool = True) -> GenerationDefaults:
    """The defaults for an EngineConfig (its model, generation_config and override_generation_config).

    Raises ConfigError (at start-up, before anything compiles) for a DIR without the file, or a file
    whose values are out of range."""
    mode = getattr(settings, "generation_config", "auto") or "auto"
    override_text = getattr(settings, "override_generation_config", None)
    override = json.loads(override_text) if override_text else {}
    if mode == "vllm":
        file_values, source = {}, "jaxserve's built-in defaults (generation_config=vllm)"
    else:
        if mode == "auto":
            directory = getattr(settings, "model", None)
            path = os.path.join(directory, GENERATION_CONFIG_FILE) if directory else None
            if path is None or not os.path.isfile(path):
                path = None
        else:
            path = mode if os.path.isfile(mode) else os.path.join(mode, GENERATION_CONFIG_FILE)
            if not os.path.isfile(path):
                raise ConfigError(
                    f"generation_config {mode!r}: no {GENERATION_CONFIG_FILE} there (give 'auto', "
                    f"'vllm', or a directory holding a {GENERATION_CONFIG_FILE})"
                )
        if path is None:
            file_values, source = {}, "jaxserve's built-in defaults (the model has no generation_config.json)"
        else:
            file_values, source = read_generation_config(path), path
        if path is not None and not any(k in file_values for k in OVERRIDE_KEYS):
            source = f"jaxserve's built-in defaults ({path} sets no sampling values)"
    defaults = resolve(file_values, override, source)
    if log:
        logger.info("%s", defaults.describe())
    return defaults
