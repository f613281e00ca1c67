"""What the server needs from an engine: `ServingEngine`, met by `AsyncLLMEngine` and the mock engine.

Every engine takes `jaxserve.sampling_params.SamplingParams` with all its fields (n, stop strings,
penalties, logprobs, ...), so the server builds one SamplingParams per prompt and never asks which
fields an engine knows. Outputs are cumulative `RequestOutput`s (vLLM's shape): each one carries the
request's whole text and token ids so far; the server computes what is new.

No jax here: the server imports this with the mock engine too.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterable, Protocol, runtime_checkable

from jaxserve.config import EngineConfig
from jaxserve.sampling_params import RequestOutput, SamplingParams


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
    def settings(self) -> EngineConfig | None:
        """The engine's settings; the server reads the model's generation defaults from them."""

    def start(self) -> None:
        """Start the step thread (idempotent)."""

    def shutdown(self) -> None:
        """Stop the step thread and release the engine."""

    def generate(self, request_id: str, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                 prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output each step it advances. A bad request raises RequestError
        before the first output (the server's 400); closing the iterator early aborts the request."""

    async def abort(self, request_id: str) -> None:
        """Abort a request between steps."""

    def stats(self) -> dict[str, Any]:
        """Counters for /metrics and --max-waiting (`num_waiting`, `num_running`, pages, ...). May block
        for up to a step: call it from a worker thread, not the event loop."""


__all__ = ["ServerTokenizer", "ServingEngine"]
