"""What the server needs from an engine: `ServingEngine`, met by `AsyncLLMEngine` and the mock engine.

Every engine has a `processor` (`jaxserve.engine.processor.Processor`), the one way in: the server
makes each prompt's checked `EngineRequest` with it and `submit`s that. Every engine takes
`SamplingParams` with all its fields (n, stop strings, penalties, logprobs, ...), so the server builds
one SamplingParams per HTTP request and never asks which fields an engine knows. Outputs are deltas:
each `RequestOutput` carries what is new since the last (token ids, text, logprob entries, the finish
reason once), put in the queue the server gave `submit`, one queue per HTTP request shared by its prompts.

LoRA adapters (`LoRAServingEngine`): an engine whose `config.enable_lora` is on also has `add_lora`,
`remove_lora`, `list_loras` and runs an EngineRequest's `lora_request`; the server sets it only for a
request that names an adapter, so an engine without adapters needs none of it.

No jax here: the server imports this with the mock engine too.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable, Protocol, runtime_checkable

from jaxserve.config import EngineConfig
from jaxserve.engine.processor import EngineRequest, Processor
from jaxserve.lora.request import LoRARequest


@runtime_checkable
class ServerTokenizer(Protocol):
    """The tokenizer calls the server makes (prompts in, token strings of logprobs and echo out)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...


@runtime_checkable
class ServingEngine(Protocol):
    """A started engine the server submits requests to; only these members are used."""

    @property
    def tokenizer(self) -> ServerTokenizer | None:
        """None: the model has no tokenizer; prompts must be token ids and chat is refused."""

    @property
    def max_model_len(self) -> int | None:
        """Prompt + generated tokens per sequence (the server answers 400 past it); None: no stated limit."""

    @property
    def config(self) -> EngineConfig | None:
        """The engine's configuration; the server reads the model's generation defaults from them."""

    @property
    def processor(self) -> Processor:
        """Prompts to checked EngineRequests against what this engine can serve (PromptError: a 400)."""

    def start(self) -> None:
        """Start the step thread (idempotent)."""

    def shutdown(self) -> None:
        """Stop the step thread and release the engine."""

    async def submit(self, request: EngineRequest, queue: asyncio.Queue, tag: Any = None) -> None:
        """Queue a request its `processor` made (RequestError, the server's 400, for an id in use or
        what only the engine can refuse); from then on `queue` gets `(tag, delta)` each step it
        advances, the last with `finished` set, or `(tag, exception)` if it fails."""

    def abort(self, request_id: str) -> None:
        """Abort a request between steps (from any thread; unknown or finished ids are ignored)."""

    def stats(self) -> dict[str, Any]:
        """Counters for /metrics and --max-waiting (`num_waiting`, `num_running`, pages, ...). May block
        for up to a step: call it from a worker thread, not the event loop."""


@runtime_checkable
class LoRAServingEngine(ServingEngine, Protocol):
    """A `ServingEngine` serving LoRA adapters (`config.enable_lora`): what server/lora.py calls."""

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter (its files read off the event loop); LoRAError (the server's 400)
        names what is wrong: a missing path or file, a rank above max_lora_rank, a module it cannot
        adapt, a name already loaded."""

    async def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter; requests already running with it finish. LoRANotFoundError if not loaded."""

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded now (a snapshot; any thread). `stats()["lora"]` counts their requests:
        {"max_loras", "running": {name: n}, "waiting": {name: n}, "resident": [names], "cpu_cached":
        [names], "loads_total", "evictions_total"}."""


__all__ = ["LoRAServingEngine", "ServerTokenizer", "ServingEngine"]
