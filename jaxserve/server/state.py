"""What the app holds: `ServerOptions` (fixed at start-up) and `ServerState` (the engine once warm,
readiness and draining, the chat renderer, the generation defaults, the metrics, the LoRA adapters' view),
with the checks every generation request passes first (ready, model name or adapter, queue bound)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Sequence

from jaxserve.config.generation_config import BUILT_IN, GenerationDefaults, load_generation_defaults
from jaxserve.lora.request import LoRARequest
from jaxserve.server.chat import ChatRenderer, ChatTemplateError
from jaxserve.server.engine_protocol import ServerTokenizer, ServingEngine
from jaxserve.server.errors import APIError
from jaxserve.server.lora import ServerLoRA
from jaxserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclasses.dataclass
class ServerOptions:
    served_model_names: Sequence[str] = ("jaxserve",)
    model_path: str | None = None  # also accepted as a model name
    api_key: str | None = None
    max_waiting: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    device_bandwidth: float | None = None
    weights_note: str | None = None  # e.g. "dummy weights", shown by /v1/models and /v1/capabilities
    # Built and checked at start-up (serve.py), before the engine compiles; None: built from the engine.
    chat_renderer: ChatRenderer | None = None
    generation_defaults: GenerationDefaults | None = None
    # tool_choice "auto": the format the model writes its calls in (tool_parsers.PARSERS; --tool-call-parser)
    tool_call_parser: str | None = "hermes"  # None: --no-enable-auto-tool-choice (tool_choice auto is a 400)
    # chat: the reasoning format (reasoning_parsers.REASONING_PARSERS; --reasoning-parser); None: all content
    reasoning_parser: str | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora-updating); None: vLLM's
    # environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING decides (1 or true: on)
    allow_runtime_lora_updating: bool | None = None


class ServerState:
    def __init__(self, options: ServerOptions):
        self.options = options
        self.engine: ServingEngine | None = None
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.owns_engine = False  # shut the engine down with the app (serve.py), or leave it to the caller
        self.pending_first = 0  # engine requests submitted whose first output has not arrived
        self.metrics = ServerMetrics(self._stats, options.device_bandwidth)
        self.chat: ChatRenderer | None = options.chat_renderer
        self.generation_defaults: GenerationDefaults = options.generation_defaults or BUILT_IN
        self.created = int(time.time())
        self.lora = ServerLoRA(self)

    # ---- engine -------------------------------------------------------------------------------
    def set_engine(self, engine: ServingEngine, owned: bool = True) -> None:
        """Attach a started, warm engine; from now on /health is 200. An owned engine is shut down with the app."""
        self.engine = engine
        self.owns_engine = owned
        if self.options.chat_renderer is None:
            try:
                self.chat = ChatRenderer(engine.tokenizer)
            except ChatTemplateError as err:
                logger.warning("%s; chat requests will use the ChatML fallback", err)
                self.chat = ChatRenderer(None)
        if self.options.generation_defaults is None:
            config = engine.config
            self.generation_defaults = load_generation_defaults(config) if config is not None else BUILT_IN
        self.ready = True

    def _stats(self) -> dict | None:
        if self.engine is None:
            return None
        try:
            return self.engine.stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because stats did
            logger.exception("engine.stats() failed")
            return None

    @property
    def tokenizer(self) -> ServerTokenizer | None:
        return self.engine.tokenizer if self.engine is not None else None

    @property
    def max_model_len(self) -> int | None:
        return self.engine.max_model_len if self.engine is not None else None

    # ---- the checks before a request reaches the engine ------------------------------------------
    def model_name(self) -> str:
        return self.options.served_model_names[0]

    def check_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """(the name responses echo, the LoRA adapter the request runs with): a base model name (or
        none) runs without one, a loaded adapter's name with it (as in vLLM); anything else is a 404
        naming what is served."""
        names = list(self.options.served_model_names)
        if name is None or name in names or (self.options.model_path and name == self.options.model_path):
            return (names[0] if name is None else name), None
        adapter = self.lora.lookup(name)
        if adapter is not None:
            return name, adapter
        served = ", ".join(map(repr, names))
        adapters = [a.lora_name for a in self.lora.adapters()]
        if adapters:
            served += f" and the LoRA adapters {', '.join(map(repr, adapters))}"
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {served}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )

    def check_ready(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="draining")
        if not self.ready:
            message = "the model is still loading; retry when GET /health returns 200"
            if self.load_error:
                message = f"the model failed to load: {self.load_error}"
            raise APIError(503, message, type="service_unavailable", code="not_ready")

    async def check_queue(self) -> None:
        bound = self.options.max_waiting
        if bound is None:
            return
        # stats() may wait for the engine's step lock: keep the event loop free meanwhile
        stats = await asyncio.to_thread(self._stats) or {}
        waiting = max(int(stats.get("num_waiting", 0) or 0), self.pending_first)
        if waiting >= bound:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise APIError(
                503,
                f"the server is overloaded: {waiting} requests are waiting (--max-waiting {bound}); retry later",
                type="service_unavailable",
                code="queue_full",
            )
