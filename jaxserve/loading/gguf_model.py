"""A GGUF file served as a model directory: its metadata written once as Hugging Face's small files.

Every other part of jaxserve (ModelConfig, the tokenizer loader, generation defaults, chat templates,
the planner) reads a Hugging Face directory. Rather than teach each of them GGUF, the file's metadata
is translated once into such a directory, a few small text files kept in jaxserve's cache and keyed
by the file's path, size and modification time and the sidecar files' contents:
- `config.json` (loading/gguf_config.py), `tokenizer.json`, `tokenizer_config.json` and
  `generation_config.json` (loading/gguf_tokenizer.py: llama.cpp's tokenization, bos/eos, the ids
  llama.cpp stops on, the chat template);
- the values of a `generation_config.json` lying beside the GGUF file merged over that one (a GGUF
  file carries no sampling defaults; the default model ships its model card's);
- `gguf_source.json`, naming the GGUF file and where each tensor lies in it, from which the weights
  are read at load (checkpoint.iter_checkpoint_tensors -> loading/gguf_weights.py), never copied;
- `checksums.json`, the SHA-256 of each of those files: a directory whose files do not match it (a
  truncated tokenizer.json stopped the server at start) is written again, with one warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np

from jaxserve.errors import ModelLoadError
from jaxserve.loading.gguf_config import gguf_architecture, hf_config
from jaxserve.loading.gguf_file import open_gguf, read_metadata

logger = logging.getLogger(__name__)

SOURCE_FILE = "gguf_source.json"
CHECKSUMS = "checksums.json"
_FORMAT = 4  # bump when the files written here change meaning, so stale cache entries are rebuilt
_SIDECARS = ("generation_config.json",)


def cache_root() -> Path:
    base = os.environ.get("JAXSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
    return Path(base) / "gguf"


def gguf_source(model_dir: str | os.PathLike) -> Path | None:
    """The GGUF file a directory made by `model_dir_for` stands for (None for any other directory)."""
    marker = Path(model_dir) / SOURCE_FILE
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text(encoding="utf-8"))["file"])


def model_dir_for(gguf_path: str | os.PathLike, sidecar_dir: str | os.PathLike | None = None) -> str:
    """The model directory standing for `gguf_path`, written on first use. `sidecar_dir` holds files
    (generation_config.json) to serve with the model; by default the GGUF file's own folder."""
    path = Path(gguf_path).resolve()
    sidecars = Path(sidecar_dir) if sidecar_dir is not None else path.parent
    stat = path.stat()
    extra = {name: (sidecars / name).read_text(encoding="utf-8") for name in _SIDECARS if (sidecars / name).is_file()}
    key = hashlib.sha256(f"{_FORMAT}|{path}|{stat.st_size}|{stat.st_mtime_ns}|{json.dumps(extra)}".encode())
    target = cache_root() / f"{path.stem}-{key.hexdigest()[:16]}"
    if target.is_dir():
        damage = check_files(target)
        if damage is None:
            return str(target)
        logger.warning("%s: %s; writing it again from %s", target, damage, path)
    files = describe(path)
    for name, text in extra.items():  # its values over the file's (the stop ids llama.cpp would use)
        try:
            values = json.loads(text)
        except ValueError as err:
            raise ModelLoadError(f"{sidecars / name} is not valid JSON ({err})") from None
        files[name] = json.dumps({**json.loads(files.get(name, "{}")), **values}, indent=2)
    return str(_write_atomically(target, files))


def describe(path: Path) -> dict[str, str]:
    """File name -> text of the directory standing for the GGUF file at `path`."""
    from jaxserve.loading.gguf_tokenizer import tokenizer_files

    reader = open_gguf(path)
    metadata = read_metadata(reader)
    gguf_architecture(metadata)  # an unsupported architecture fails here, before the tokenizer is built
    tensors = {t.name: t for t in reader.tensors}
    config = hf_config(metadata, set(tensors))
    if "rope_freqs.weight" in tensors and config["model_type"] in ("llama", "mistral", "mixtral"):
        from jaxserve.loading.gguf_weights import dequantize, llama3_rope_scaling

        config["rope_scaling"] = llama3_rope_scaling(
            dequantize(tensors["rope_freqs.weight"]), config["head_dim"], config["rope_theta"]
        )
    files = dict(tokenizer_files(metadata))
    files["config.json"] = json.dumps(config, indent=2)
    # Where each tensor's bytes are: loading then maps the file without parsing its header again
    # (the reader spends seconds on a large vocabulary's token list, which loading does not need).
    index = [
        [t.name, int(t.tensor_type), t.data.dtype.str, list(t.data.shape), int(t.data_offset)] for t in reader.tensors
    ]
    files[SOURCE_FILE] = json.dumps(
        {
            "file": str(path),
            "architecture": metadata["general.architecture"],
            "size": path.stat().st_size,
            "tensors": index,
        }
    )
    return files


class _IndexedTensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # a read-only view of the mapped file, as gguf.GGUFReader gives it


def iter_gguf_tensors(model_dir: str) -> Iterator[tuple[str, str, np.ndarray]]:
    """(file, transformers name, float32 array) for each weight of the GGUF file behind `model_dir`."""
    from gguf import GGMLQuantizationType

    from jaxserve.loading.gguf_weights import iter_hf_tensors

    with open(Path(model_dir) / SOURCE_FILE, encoding="utf-8") as f:
        source = json.load(f)
    with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    path = Path(source["file"])
    if path.stat().st_size != source["size"]:
        raise ModelLoadError(f"{path} changed since {model_dir} was made from it; start again to re-read it")
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = [
        _IndexedTensor(
            name, GGMLQuantizationType(kind), np.ndarray(tuple(shape), np.dtype(dtype), buffer=mapped, offset=offset)
        )
        for name, kind, dtype, shape, offset in source["tensors"]
    ]
    for name, values in iter_hf_tensors(source["architecture"], tensors, config):
        yield str(path), name, values


def check_files(folder: Path) -> str | None:
    """None when every file `checksums.json` lists is there with its SHA-256; else what is wrong."""
    try:
        sums = json.loads((folder / CHECKSUMS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"{CHECKSUMS} missing or damaged"
    if not isinstance(sums, dict) or SOURCE_FILE not in sums:
        return f"{CHECKSUMS} damaged"
    for name, digest in sums.items():
        try:
            data = (folder / name).read_bytes()
        except OSError:
            return f"{name} missing"
        if hashlib.sha256(data).hexdigest() != digest:
            return f"{name} damaged (checksum mismatch)"
    return None


def _write_atomically(target: Path, files: dict[str, str]) -> Path:
    """Write the files (and their checksums) into a fresh folder and rename it into place, so a
    concurrent start (several hosts of a multi-host job, two servers) never reads a half-written
    directory; a damaged one there is moved aside first. Where the cache is not writable, a private
    temporary directory serves this process instead."""
    files = dict(files)
    files[CHECKSUMS] = json.dumps({n: hashlib.sha256(t.encode("utf-8")).hexdigest() for n, t in files.items()})
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    except OSError:
        staging = target = Path(tempfile.mkdtemp(prefix="jaxserve-gguf-"))
    for name, text in files.items():
        (staging / name).write_text(text, encoding="utf-8")
    if staging == target:
        return target
    if target.exists() and check_files(target) is not None:  # damaged: out of the way (another may race)
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}-damaged-", dir=target.parent))
        try:
            os.rename(target, aside / "old")
        except OSError:
            pass
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(staging, target)
    except OSError:  # another process got there first: theirs is the same
        shutil.rmtree(staging, ignore_errors=True)
    if check_files(target) is not None:  # still not whole (a racing writer's, or unwritable): ours, privately
        private = Path(tempfile.mkdtemp(prefix="jaxserve-gguf-"))
        for name, text in files.items():
            (private / name).write_text(text, encoding="utf-8")
        return private
    return target
