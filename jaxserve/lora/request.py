"""LoRARequest: which adapter a request runs with (vLLM's spelling, so scripts written for vLLM run)."""

from __future__ import annotations

import dataclasses
from typing import Any

# The modules an adapter may target, by jaxserve's keys, and their PEFT / transformers names.
LORA_MODULES = ("q", "k", "v", "o", "gate", "up", "down")
PEFT_NAMES = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter by name: `lora_name` is what a request's `model` field says, `lora_int_id` a
    positive id unique among the adapters an engine holds, `lora_path` the adapter directory
    (`adapter_config.json` + `adapter_model.safetensors`). `base_model_name`: the model it was
    trained on, as `/v1/models` shows it (informational)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRARequest needs a lora_name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def parse_lora_modules(value) -> tuple[LoRARequest, ...]:
    """vLLM's `--lora-modules`: `NAME=PATH` strings, or JSON objects `{"name": ..., "path": ...,
    "base_model_name": ...}` (as strings or dicts), one or a list of them; ids 1, 2, ... in order."""
    import json

    from jaxserve.errors import ConfigError

    if value is None or value == "" or value == ():
        return ()
    items = [value] if isinstance(value, (str, dict)) else list(value)
    out: list[LoRARequest] = []
    for item in items:
        if isinstance(item, LoRARequest):
            spec = dict(name=item.lora_name, path=item.lora_path, base_model_name=item.base_model_name)
        elif isinstance(item, dict):
            spec = dict(item)
        elif isinstance(item, str) and item.strip().startswith("{"):
            try:
                spec = json.loads(item)
            except json.JSONDecodeError as err:
                raise ConfigError(f"lora_modules: cannot read {item!r} as JSON: {err}") from None
        elif isinstance(item, str) and "=" in item:
            name, path = item.split("=", 1)
            spec = dict(name=name.strip(), path=path.strip())
        else:
            raise ConfigError(f"lora_modules: expected NAME=PATH or a JSON object with name and path, got {item!r}")
        unknown = set(spec) - {"name", "path", "base_model_name"}
        if unknown or not spec.get("name") or not spec.get("path"):
            raise ConfigError(f"lora_modules: {item!r} needs a name and a path (and at most base_model_name)")
        out.append(LoRARequest(str(spec["name"]), len(out) + 1, str(spec["path"]), spec.get("base_model_name")))
    names = [r.lora_name for r in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"lora_modules: adapter names must be unique, got {names}")
    return tuple(out)


def parse_lora_target_modules(value: Any) -> tuple[str, ...]:
    """`lora_target_modules`: PEFT's module names (q_proj ... down_proj) or jaxserve's keys (q ...
    down), a list or one comma-separated string, as jaxserve's keys in LORA_MODULES order; "all" or
    nothing: () (every module the model has)."""
    from jaxserve.errors import ConfigError

    items = value.split(",") if isinstance(value, str) else list(value or ())
    names = {n.strip() for n in items if str(n).strip()}
    if not names or names == {"all"}:
        return ()
    by_name = {name: key for key, name in PEFT_NAMES.items()}
    keys = {by_name.get(n, n) for n in names}
    unknown = sorted(keys - set(LORA_MODULES))
    if unknown:
        raise ConfigError(
            f"lora_target_modules: {', '.join(map(repr, unknown))} is not one of "
            f"{' '.join(PEFT_NAMES.values())} (or all)"
        )
    return tuple(m for m in LORA_MODULES if m in keys)
