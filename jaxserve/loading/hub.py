"""Hugging Face model IDs (`ORG/NAME`, as `vllm serve ORG/NAME`): a local snapshot directory through
huggingface_hub's cache.

Only what the engine reads is fetched, from the repository's top level: config.json, the safetensors
weights (and their index), the tokenizer files, the chat template and generation_config.json.
huggingface_hub authenticates (HF_TOKEN, or a login by `hf auth login`), and with HF_HUB_OFFLINE=1
it serves a model from the local cache without a network call. Every failure is a ModelLoadError
that says what to do, raised before anything compiles. Host-only: no jax here.
"""

from __future__ import annotations

import logging
import os
import re

from jaxserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

# The files of a transformers-layout checkpoint that jaxserve reads (checkpoint.py, tokenizer.py,
# server/chat.py, generation_config.py).
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
# Files in folders (Llama 3's original/, ONNX or quantized variants) and Mistral's own single-file
# format, which repositories ship beside the transformers shards (the same weights again, ~15 GB for
# Mistral-7B): checkpoint.py reads neither.
IGNORE_PATTERNS = ("*/*", "consolidated*.safetensors")

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?", re.ASCII)


def looks_like_repo_id(name: str) -> bool:
    """Whether `name` reads as a Hugging Face model ID, ORG/NAME, and is no existing local path.

    Each part as the Hub allows it (huggingface_hub's validate_repo_id): 1 to 96 ASCII letters, digits,
    '_', '-' or '.', starting and ending with a letter, digit or '_', with no '--' or '..', and the
    name not ending in '.git'."""
    if not isinstance(name, str) or name.count("/") != 1 or os.path.exists(os.path.expanduser(name)):
        return False
    org, repo = name.split("/")
    return (
        all(_NAME.fullmatch(part) for part in (org, repo))
        and "--" not in name
        and ".." not in name
        and not repo.endswith(".git")
    )


def download_model(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The local snapshot directory of `repo_id` at `revision` (default: main), downloaded into
    `download_dir` (a huggingface_hub cache; default: huggingface_hub's) unless it is there already.

    Raises ModelLoadError, with what to do, when the repository does not exist or is private, is gated,
    has no such revision, cannot be reached and is not cached, or has no safetensors weights."""
    import huggingface_hub
    from huggingface_hub import constants

    cache = download_dir or constants.HF_HUB_CACHE
    where = f"{repo_id}" + (f" (revision {revision!r})" if revision else "")
    if constants.HF_HUB_OFFLINE:
        logger.info("HF_HUB_OFFLINE is set: looking for %s in the cache at %s", where, cache)
    else:
        logger.info("resolving %s on the Hugging Face Hub (cache: %s)", where, cache)
    try:
        path = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
        )
    except Exception as err:  # noqa: BLE001 - every huggingface_hub failure becomes a ModelLoadError
        raise _load_error(err, repo_id, revision, cache) from err
    _check_snapshot(str(path), repo_id, revision)
    logger.info("%s: %s", where, path)
    return str(path)


def _load_error(err: Exception, repo_id: str, revision: str | None, cache: str) -> ModelLoadError:
    """What went wrong, in words, with what to do about it."""
    from huggingface_hub import constants, errors

    page = f"https://huggingface.co/{repo_id}"
    if isinstance(err, errors.GatedRepoError):  # before RepositoryNotFoundError, its base class
        return ModelLoadError(
            f"{repo_id} is a gated model: log in at {page}, accept its licence there, then give this process "
            "a token of that account: set HF_TOKEN (https://huggingface.co/settings/tokens) or run "
            "`hf auth login`"
        )
    if isinstance(err, errors.RepositoryNotFoundError):
        return ModelLoadError(
            f"no model {repo_id!r} on the Hugging Face Hub, and no local path of that name: check the spelling "
            "(a model ID is ORG/NAME, e.g. Qwen/Qwen3-0.6B); if the repository is private, set HF_TOKEN to a "
            "token that can read it"
        )
    if isinstance(err, errors.RevisionNotFoundError):
        return ModelLoadError(
            f"{repo_id} has no revision {revision!r} (a branch, tag or commit hash): its branches and tags "
            f"are listed at {page}/tree/main; drop --revision for main"
        )
    if isinstance(err, errors.LocalEntryNotFoundError):
        incomplete = type(err).__name__ == "IncompleteSnapshotError"  # huggingface_hub >= 2
        what = (
            f"the cached snapshot of {repo_id} in {cache} is incomplete ({err})"
            if incomplete
            else f"{repo_id}"
            + (f" at revision {revision!r}" if revision else "")
            + f" is not in the local cache ({cache})"
        )
        if constants.HF_HUB_OFFLINE:
            return ModelLoadError(
                f"HF_HUB_OFFLINE is set and {what}: download it once with network access (unset "
                "HF_HUB_OFFLINE), or give --download-dir the cache that holds it"
            )
        return ModelLoadError(
            f"cannot reach the Hugging Face Hub ({_cause(err)}) and {what}: check the network (and HF_ENDPOINT, "
            "HTTPS_PROXY); once a model is cached, HF_HUB_OFFLINE=1 serves it without the network"
        )
    if isinstance(err, errors.HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status == 401:
            return ModelLoadError(
                f"the Hugging Face Hub refused the token for {repo_id} (401): HF_TOKEN (or "
                "the stored login) is invalid or expired; set a valid one, or unset it for a "
                "public model"
            )
        return ModelLoadError(f"the Hugging Face Hub failed for {repo_id} (HTTP {status}): {err}")
    if isinstance(err, errors.HFValidationError):
        return ModelLoadError(f"{repo_id!r} is not a valid Hugging Face model ID: {err}")
    return ModelLoadError(
        f"cannot download {repo_id} from the Hugging Face Hub ({type(err).__name__}: {err}); with the model "
        f"already in the cache ({cache}), HF_HUB_OFFLINE=1 serves it without the network"
    )


def _cause(err: BaseException) -> str:
    """The network failure under huggingface_hub's LocalEntryNotFoundError, briefly."""
    cause = err.__cause__ or err.__context__
    return f"{type(cause).__name__}: {cause}" if cause is not None else "no connection"


def _check_snapshot(path: str, repo_id: str, revision: str | None) -> None:
    """A snapshot without safetensors weights: say what the repository holds instead."""
    files = os.listdir(path)
    if any(f.endswith(".safetensors") for f in files):
        if "config.json" not in files:
            raise ModelLoadError(
                f"{repo_id} has safetensors weights but no config.json at its top level; "
                "jaxserve reads the Hugging Face transformers layout (config.json + weights)"
            )
        return
    listed = _repo_files(repo_id, revision)
    ggufs = sorted(f for f in listed if f.endswith(".gguf"))
    pickles = sorted(f for f in listed if f.endswith(_PICKLE_SUFFIXES) and "/" not in f)
    mistral = sorted(f for f in listed if f.startswith("consolidated") and f.endswith(".safetensors"))
    if ggufs:
        raise ModelLoadError(
            f"{repo_id} holds GGUF files, not safetensors ({_some(ggufs)}): download the one you want, e.g. "
            f"`hf download {repo_id} {ggufs[0]}` (prints its path), and pass that .gguf file as the model"
        )
    if pickles:
        raise ModelLoadError(
            f"{repo_id} holds only pickle weights ({_some(pickles)}); jaxserve loads safetensors only, because "
            "unpickling runs code. Look for a safetensors conversion among its pull requests (pass "
            "--revision refs/pr/N), or convert once with transformers: AutoModelForCausalLM.from_pretrained"
            f"('{repo_id}').save_pretrained(DIR, safe_serialization=True), and pass DIR"
        )
    if mistral:
        raise ModelLoadError(
            f"{repo_id} holds Mistral's own checkpoint format ({_some(mistral)}, params.json); jaxserve reads "
            "the Hugging Face transformers layout (config.json + model*.safetensors)"
        )
    known = "" if listed else " (the file list could not be read: offline?)"
    raise ModelLoadError(
        f"{repo_id} has no safetensors weights at its top level{known}; jaxserve loads a "
        "transformers-layout checkpoint (config.json + *.safetensors) or a .gguf file"
    )


def _repo_files(repo_id: str, revision: str | None) -> list[str]:
    """The repository's file list, or [] when it cannot be read (offline, no network)."""
    import huggingface_hub
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return []
    try:
        return list(huggingface_hub.list_repo_files(repo_id, revision=revision))
    except Exception as err:  # noqa: BLE001 - only for a better message
        logger.debug("cannot list the files of %s: %s", repo_id, err)
        return []


def _some(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names)} files)" if len(names) > most else "")
