"""Exception types users can catch: each names the problem in words, never an XLA traceback."""


class JaxServeError(Exception):
    """Base class of every error jaxserve raises on purpose."""


class ConfigError(JaxServeError, ValueError):
    """A setting is unknown, malformed, or contradicts another setting."""


class ModelLoadError(JaxServeError):
    """A checkpoint or model directory cannot be loaded (missing files, bad format, unsupported)."""


class UnsupportedModelError(ModelLoadError, ValueError):
    """The checkpoint's architecture or one of its options is not implemented."""


class RequestError(JaxServeError, ValueError):
    """A request cannot be served as asked (too long, bad sampling parameters, bad token ids)."""


class EngineClosedError(JaxServeError, RuntimeError):
    """The engine was closed (`LLM.close()`, `LLMEngine.close()`): its executables and buffers are released."""


class LoRAError(RequestError):
    """A LoRA adapter cannot be loaded or used as asked (missing files, a rank above max_lora_rank, a
    module the engine cannot adapt, a name already taken): the server's 400."""


class LoRANotFoundError(LoRAError):
    """No adapter of that name is loaded: the server's 404."""


class EngineSleepingError(JaxServeError, RuntimeError):
    """The engine is asleep (`sleep(level)`): its weights or KV cache are off the devices until
    `wake_up()` (or `update_weights` for level 2's weights); the server's 503."""


class EnginePausedError(JaxServeError, RuntimeError):
    """Generation is paused (`pause(mode)`) until `resume()`."""


class WeightsDeletedError(JaxServeError, RuntimeError):
    """A weight the engine serves was deleted by someone else: `update_weights` adopted the caller's
    array without a copy, and a later computation donated or deleted it (a trainer's step)."""
