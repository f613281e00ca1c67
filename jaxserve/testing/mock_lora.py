"""The mock engine's LoRA adapters: `AsyncLLMEngine`'s adapter API (`add_lora`, `remove_lora`,
`list_loras`, `stats()["lora"]`) without weights, so the server's LoRA routes run without a model.

What is real (cheap): an adapter directory must exist and hold `adapter_config.json`, whose rank `r`
may not pass `max_lora_rank`, whose `target_modules` must be among the seven jaxserve adapts and which
may not be DoRA; names and ids are unique; a request naming an adapter not loaded is refused. What is
simulated: device residency (`max_loras` slots, least recently used swapped out, a load counted each
time an adapter enters a slot), the host cache (`max_cpu_loras`), and admission (a request of an
adapter not among the running ones waits while `max_loras` adapters run). The mock's tokens depend on
the adapter's name (`digest_salt`), so a test sees which adapter a request ran with.

Not thread-safe on its own: the mock engine calls it under its lock.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Iterable

from jaxserve.errors import LoRAError, LoRANotFoundError
from jaxserve.lora.request import PEFT_NAMES, LoRARequest

TARGET_MODULES = tuple(PEFT_NAMES.values())


def read_adapter_config(request: LoRARequest, max_rank: int) -> dict:
    """The checks a real load makes first, on `adapter_config.json` alone (no weights read)."""
    path = request.lora_path
    if not path or not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: no adapter directory at {path!r}")
    config_file = os.path.join(path, "adapter_config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: {config_file} does not exist") from None
    except (OSError, ValueError) as err:
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: cannot read {config_file}: {err}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: {config_file} is not a JSON object")
    rank = config.get("r", 8)
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: rank r={rank!r} is not a positive integer")
    if rank > max_rank:
        raise LoRAError(
            f"LoRA adapter {request.lora_name!r} has rank {rank}, above max_lora_rank={max_rank} (--max-lora-rank)"
        )
    if config.get("use_dora"):
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: DoRA (use_dora) is not supported")
    targets = config.get("target_modules") or ["q_proj", "v_proj"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    unsupported = sorted(set(targets) - set(TARGET_MODULES))
    if unsupported:
        raise LoRAError(
            f"LoRA adapter {request.lora_name!r} targets {', '.join(unsupported)}: only "
            f"{', '.join(TARGET_MODULES)} can be adapted"
        )
    return config


class MockLoRAManager:
    """Registered adapters, simulated device slots and host cache, and the counters of `stats()["lora"]`."""

    def __init__(
        self,
        enabled: bool,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None,
        modules: Iterable[LoRARequest] = (),
    ):
        self.enabled = enabled
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.registered: dict[str, LoRARequest] = {}
        self.resident: OrderedDict[str, None] = OrderedDict()  # device slots, least recently used first
        self.cpu_cached: OrderedDict[str, None] = OrderedDict()  # host copies, least recently used first
        self.loads_total = 0
        self.evictions_total = 0
        for request in modules:  # --lora-modules: loaded at start, so a bad one stops the start
            self.check(request)
            read_adapter_config(request, max_lora_rank)
            self.register(request)

    # ---- the adapter API ---------------------------------------------------------------------------
    def check(self, request: LoRARequest) -> None:
        """What `add_lora` refuses before it reads the adapter (then `read_adapter_config`, off the loop)."""
        if not self.enabled:
            raise LoRAError("LoRA is not enabled: start the engine with enable_lora=true (--enable-lora)")
        if not isinstance(request, LoRARequest):
            raise LoRAError(f"expected a LoRARequest, got {type(request).__name__}")
        self.check_new(request)

    def check_new(self, request: LoRARequest) -> None:
        if request.lora_name in self.registered:
            raise LoRAError(f"a LoRA adapter named {request.lora_name!r} is already loaded")
        for other in self.registered.values():
            if other.lora_int_id == request.lora_int_id:
                raise LoRAError(f"lora_int_id {request.lora_int_id} is already used by adapter {other.lora_name!r}")

    def register(self, request: LoRARequest) -> None:
        self.check_new(request)  # again, under the lock: another load may have taken the name meanwhile
        self.registered[request.lora_name] = request
        self._touch(self.cpu_cached, request.lora_name, self.max_cpu_loras)

    def remove(self, name: str) -> None:
        """Forget the adapter; requests already running with it keep it until they finish."""
        if name not in self.registered:
            loaded = ", ".join(map(repr, self.registered)) or "none"
            raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        del self.registered[name]
        self.cpu_cached.pop(name, None)
        self.resident.pop(name, None)

    def list(self) -> list[LoRARequest]:
        return list(self.registered.values())

    # ---- requests ----------------------------------------------------------------------------------
    def check_request(self, request: LoRARequest | None) -> None:
        """A request's adapter must be loaded (and LoRA on): LoRANotFoundError is the server's 404."""
        if request is None:
            return
        if not self.enabled:
            raise LoRAError("this engine does not serve LoRA adapters (enable_lora is off)")
        if self.registered.get(request.lora_name) != request:
            raise LoRANotFoundError(f"the LoRA adapter {request.lora_name!r} is not loaded")

    def admissible(self, request: LoRARequest | None, running: Iterable[LoRARequest | None]) -> bool:
        """A request of an adapter not among the running ones waits while max_loras adapters run."""
        if request is None:
            return True
        in_use = {r.lora_name for r in running if r is not None}
        return request.lora_name in in_use or len(in_use) < self.max_loras

    def admit(self, request: LoRARequest | None, running: Iterable[LoRARequest | None]) -> None:
        """Put the adapter in a device slot (a load), swapping out the least recently used one no
        running request uses (an eviction)."""
        if request is None:
            return
        name = request.lora_name
        if name not in self.resident:
            in_use = {r.lora_name for r in running if r is not None}
            if len(self.resident) >= self.max_loras:
                victim = next((n for n in self.resident if n not in in_use), None)
                if victim is not None:
                    del self.resident[victim]
                    self.evictions_total += 1
            self.loads_total += 1
        self._touch(self.resident, name, None)
        if name in self.registered:
            self._touch(self.cpu_cached, name, self.max_cpu_loras)

    @staticmethod
    def digest_salt(request: LoRARequest | None) -> bytes:
        """What makes an adapter's tokens differ from the base model's and from other adapters'."""
        return b"" if request is None else b"lora:" + request.lora_name.encode()

    @staticmethod
    def _touch(cache: OrderedDict, name: str, bound: int | None) -> None:
        cache[name] = None
        cache.move_to_end(name)
        while bound is not None and len(cache) > bound:
            cache.popitem(last=False)

    def stats(self, running: Iterable[LoRARequest | None], waiting: Iterable[LoRARequest | None]) -> dict:
        def count(requests):
            out: dict[str, int] = {}
            for r in requests:
                if r is not None:
                    out[r.lora_name] = out.get(r.lora_name, 0) + 1
            return out

        return {
            "max_loras": self.max_loras,
            "running": count(running),
            "waiting": count(waiting),
            "resident": list(self.resident),
            "cpu_cached": list(self.cpu_cached),
            "loads_total": self.loads_total,
            "evictions_total": self.evictions_total,
        }


__all__ = ["MockLoRAManager", "read_adapter_config"]
