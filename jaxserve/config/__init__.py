"""Configuration: the engine's settings (one field = keyword, YAML key, CLI flag), the model's
architecture (from config.json or GGUF metadata) and the model's generation defaults. Host only."""

from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelConfig

__all__ = ["EngineConfig", "ModelConfig"]
