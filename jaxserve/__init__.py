"""jaxserve: an LLM inference engine in JAX (paged KV cache, continuous batching, Pallas kernels, sharding)."""

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.errors import ConfigError, JaxServeError, ModelLoadError, RequestError, UnsupportedModelError
from jaxserve.sampling.params import CompletionOutput, RequestOutput, SamplingParams


def __getattr__(name):
    # LLM pulls in the engine; import it lazily so `import jaxserve` stays cheap.
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig", "ModelConfig",
    "JaxServeError", "ConfigError", "ModelLoadError", "RequestError", "UnsupportedModelError",
]
