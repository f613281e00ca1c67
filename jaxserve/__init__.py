"""jaxserve: an LLM inference engine in JAX (paged KV cache, continuous batching, Pallas kernels, sharding)."""

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.errors import (
    ConfigError,
    JaxServeError,
    LoRAError,
    LoRANotFoundError,
    ModelLoadError,
    RequestError,
    UnsupportedModelError,
)
from jaxserve.lora.request import LoRARequest
from jaxserve.sampling.params import CompletionOutput, RequestOutput, SamplingParams


def __getattr__(name):
    # These pull in JAX and the engine; imported lazily so `import jaxserve` stays cheap.
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    if name == "LLMEngine":
        from jaxserve.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from jaxserve.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)


__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLMEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineConfig",
    "ModelConfig",
    "JaxServeError",
    "ConfigError",
    "ModelLoadError",
    "RequestError",
    "UnsupportedModelError",
    "LoRARequest",
    "LoRAError",
    "LoRANotFoundError",
]
