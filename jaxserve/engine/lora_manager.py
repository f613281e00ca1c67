"""Which LoRA adapters the engine knows, which are in host memory, and which device slot holds each.

Host only (no jax). Three tiers, as vLLM keeps them:

* registered: name -> `Adapter` (`--lora-modules`, `POST /v1/load_lora_adapter`, or a request naming
  a new `LoRARequest` offline);
* host memory: the adapters' weights (`lora.peft_adapter.PeftAdapter`), at most `max_cpu_loras` of
  them beyond those live requests use, least recently used dropped first (read again from disk when
  a request needs one);
* device: `max_loras` slots of the runner's stacks (`runner/lora.py`). A step's adapters are put
  into slots before it runs (`prepare`): into a free slot, else the least recently used one that
  the step does not use. The scheduler admits requests of at most `max_loras` adapters among the
  running ones, so a step's adapters always fit.

An adapter's registration gets a serial number of its own, which keys its prefix-cache pages
(`prefix_root`): two adapters, or one unloaded and loaded again, never share KV pages.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
from typing import Any, Callable, Iterable

from jaxserve.errors import LoRAError, LoRANotFoundError
from jaxserve.lora.request import LoRARequest


@dataclasses.dataclass(eq=False)
class Adapter:
    """One registration of an adapter: its request, its prefix-cache root key, its weights while in
    host memory and its device slot while resident."""

    request: LoRARequest
    serial: int
    prefix_root: bytes
    weights: Any = None
    slot: int | None = None
    registered: bool = True

    @property
    def name(self) -> str:
        return self.request.lora_name


class LoRAManager:
    """`load(request) -> weights` reads an adapter (raising LoRAError); `write(slot, weights)` puts
    one into a device slot (the runner's `write_lora`); `live()` gives the adapters that running or
    waiting requests use (their weights stay in host memory)."""

    def __init__(
        self,
        *,
        max_loras: int,
        max_cpu_loras: int | None,
        load: Callable[[LoRARequest], Any],
        write: Callable[[int, Any], None],
        live: Callable[[], set],
    ):
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self._load, self._write, self._live = load, write, live
        self.registered: dict[str, Adapter] = {}
        self.slots: list[Adapter | None] = [None] * max_loras
        self._slot_used = [0] * max_loras  # when each slot last served a step (LRU)
        self._host: collections.OrderedDict[Adapter, None] = collections.OrderedDict()  # weights held, LRU first
        self._serials = itertools.count(1)
        self._clock = itertools.count(1)
        self.loads_total = 0  # adapters written into a device slot
        self.evictions_total = 0  # resident adapters overwritten by another
        self.snapshot: tuple[LoRARequest, ...] = ()  # what list_loras() reads from any thread

    # ---- registration --------------------------------------------------------------------------
    def read(self, request: LoRARequest) -> Any:
        """An adapter's weights from its files (LoRAError if they cannot be served): any thread."""
        return self._load(request)

    def add(self, request: LoRARequest, weights: Any = None) -> Adapter:
        """Register `request` (its weights read now unless given); LoRAError if its name or id is taken
        or the adapter cannot be loaded."""
        if request.lora_name in self.registered:
            raise LoRAError(f"the LoRA adapter {request.lora_name!r} is already loaded")
        taken = next((a for a in self.registered.values() if a.request.lora_int_id == request.lora_int_id), None)
        if taken is not None:
            raise LoRAError(f"lora_int_id {request.lora_int_id} is already used by the adapter {taken.name!r}")
        if weights is None:
            weights = self._load(request)
        serial = next(self._serials)
        root = hashlib.blake2b(b"jaxserve-lora:%d" % serial, digest_size=32).digest()
        adapter = Adapter(request, serial, root, weights)
        self.registered[request.lora_name] = adapter
        self._hold(adapter)
        self.snapshot = tuple(a.request for a in self.registered.values())
        return adapter

    def remove(self, name: str) -> None:
        """Unregister `name`: new requests cannot use it; those already using it finish with it."""
        adapter = self.registered.pop(name, None)
        if adapter is None:
            raise LoRANotFoundError(f"the LoRA adapter {name!r} is not loaded")
        adapter.registered = False
        self.snapshot = tuple(a.request for a in self.registered.values())
        if adapter.slot is not None and adapter not in self._live():
            self._slot_used[adapter.slot] = 0  # the first slot to reuse
        self._trim_host()

    def resolve(self, request: LoRARequest) -> Adapter:
        """The registered adapter a request names (offline, a new LoRARequest registers itself, as in
        vLLM), its weights in host memory; LoRAError when the name is registered with another id or path."""
        adapter = self.registered.get(request.lora_name)
        if adapter is None:
            if not request.lora_path:
                raise LoRANotFoundError(f"the LoRA adapter {request.lora_name!r} is not loaded")
            return self.add(request)
        known = adapter.request
        if request.lora_int_id != known.lora_int_id or (request.lora_path and request.lora_path != known.lora_path):
            raise LoRAError(
                f"the LoRA adapter {request.lora_name!r} is loaded as id {known.lora_int_id} from "
                f"{known.lora_path!r}, not id {request.lora_int_id} from {request.lora_path!r}"
            )
        if adapter.weights is None:
            adapter.weights = self._load(adapter.request)
        self._hold(adapter)
        return adapter

    # ---- device slots --------------------------------------------------------------------------
    def prepare(self, adapters: Iterable[Adapter]) -> None:
        """Put every adapter of a step into a device slot (at most `max_loras` of them)."""
        step = set(adapters)
        if len(step) > self.max_loras:
            raise RuntimeError(f"a step uses {len(step)} adapters; max_loras is {self.max_loras}")
        now = next(self._clock)
        for adapter in step:
            if adapter.slot is None:
                self._place(adapter, step)
            self._slot_used[adapter.slot] = now

    def _place(self, adapter: Adapter, step: set) -> None:
        free = [i for i, held in enumerate(self.slots) if held is None]
        slot = (
            free[0]
            if free
            else min((i for i, held in enumerate(self.slots) if held not in step), key=self._slot_used.__getitem__)
        )
        old = self.slots[slot]
        if old is not None:
            old.slot = None
            self.evictions_total += 1
        if adapter.weights is None:  # dropped from host memory since it was resolved: read it again
            adapter.weights = self._load(adapter.request)
        self._write(slot, adapter.weights)
        self.slots[slot], adapter.slot = adapter, slot
        self.loads_total += 1
        self._hold(adapter)

    # ---- host memory ---------------------------------------------------------------------------
    def _hold(self, adapter: Adapter) -> None:
        """`adapter`'s weights are the most recently used; past max_cpu_loras the oldest unused go."""
        self._host[adapter] = None
        self._host.move_to_end(adapter)
        if len(self._host) > self.max_cpu_loras:  # (the trim scans the live requests: not per admission)
            self._trim_host()

    def _trim_host(self) -> None:
        """Drop the weights of the least recently used adapters no live request uses, past max_cpu_loras
        (and of unregistered ones at once)."""
        live = self._live()
        for adapter in list(self._host):  # least recently used first
            if adapter not in live and (len(self._host) > self.max_cpu_loras or not adapter.registered):
                adapter.weights = None
                del self._host[adapter]

    # ---- observability -------------------------------------------------------------------------
    def stats(self, running: Iterable[Adapter | None], waiting: Iterable[Adapter | None]) -> dict:
        """vLLM's lora_requests_info (requests per adapter, running and waiting) and the tiers' contents."""

        def count(adapters):
            return dict(collections.Counter(a.name for a in adapters if a is not None))

        return {
            "max_loras": self.max_loras,
            "running": count(running),
            "waiting": count(waiting),
            "resident": [a.name for a in self.slots if a is not None],
            "cpu_cached": [a.name for a in self._host],
            "loads_total": self.loads_total,
            "evictions_total": self.evictions_total,
        }
