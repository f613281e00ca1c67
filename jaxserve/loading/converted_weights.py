"""Weights converted at load, kept in jaxserve's cache and mapped on the next start.

A GGUF file's weights are dequantized (or requantized) at every load: for the default model's Q4_1
file that was most of the ~5 s to the weights placed, and the larger share of a warm start once the
executables come from the store. The first load writes the converted host arrays into one file under
`~/.cache/jaxserve/weights` (`$JAXSERVE_CACHE`) with an index holding each array's place, shape, dtype,
partition spec and CRC-32, and the params' pytree definition; the next load maps that file, checks
every array's CRC-32 and places it on its sharding. A missing, truncated or damaged file is converted
again (one warning line) and rewritten: never served. The key holds the GGUF file's identity (path,
size, modification time: the model directory's name), jaxserve's source hash, the model config and
every setting that changes the converted values (dtype, quantization, group size, stacked layers).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

logger = logging.getLogger(__name__)

FORMAT = 1
_ALIGN = 64  # each array starts on a 64-byte boundary of the file


ENV = "JAXSERVE_WEIGHTS_CACHE"  # "0": converted weights are not cached (the test suite's default)


def enabled(model_dir: str) -> bool:
    """Whether this model's weights are converted at load and so kept: a GGUF file's, unless $JAXSERVE_WEIGHTS_CACHE=0."""
    from jaxserve.loading.gguf_model import gguf_source

    off = os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off")
    return not off and gguf_source(model_dir) is not None


def cache_dir() -> Path:
    base = os.environ.get("JAXSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
    return Path(base) / "weights"


def weights_key(model_dir: str, parts: dict) -> str:
    """The entry's name: the model directory's name (it carries the GGUF file's identity) and a hash
    of the settings, config and jaxserve's source."""
    from jaxserve.runner.executable_keys import describe, source_hash

    material = json.dumps(
        {"format": FORMAT, "source": source_hash(), "model_dir": os.path.abspath(model_dir), **describe(parts)},
        sort_keys=True,
    )
    return f"{Path(model_dir).name}-{hashlib.sha256(material.encode()).hexdigest()[:20]}"


def load_or_convert(model_dir: str, parts: dict, shardings: Any, convert: Callable[[], Any]) -> Any:
    """The params from the cache entry for (model_dir, parts), placed on `shardings` (a pytree like the
    params'); else `convert()`, written to the cache for the next start."""
    folder = cache_dir()
    name = weights_key(model_dir, parts)
    params = _load(folder, name, shardings)
    if params is not None:
        return params
    params = convert()
    try:
        _save(folder, name, params)
    except OSError as err:
        logger.warning("converted weights not cached (%s): the next start converts them again", err)
    return params


def _load(folder: Path, name: str, shardings: Any) -> Any:
    index_path, data_path = folder / f"{name}.json", folder / f"{name}.bin"
    if not index_path.exists():
        return None
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        treedef = pickle.loads(bytes.fromhex(index["treedef"]))
        mapped = np.memmap(data_path, dtype=np.uint8, mode="r")
        if mapped.size != index["bytes"]:
            raise ValueError(f"truncated ({mapped.size} of {index['bytes']} bytes)")
        targets = jax.tree.leaves(shardings)
        if treedef.num_leaves != len(index["arrays"]) or len(targets) != len(index["arrays"]):
            raise ValueError("another layout of the params")
        leaves = []
        for (offset, shape, dtype, crc), sharding in zip(index["arrays"], targets):
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            raw = mapped[offset : offset + size]
            if zlib.crc32(raw) != crc:
                raise ValueError("checksum mismatch")
            leaves.append(jax.device_put(raw.view(np.dtype(dtype)).reshape(shape), sharding))
    except Exception as err:  # noqa: BLE001 - anything wrong with the entry: convert again
        logger.warning("cached converted weights %s not used (%s): converting them again", data_path, err)
        return None
    logger.info("converted weights mapped from %s", data_path)
    return jax.tree.unflatten(treedef, leaves)


def _save(folder: Path, name: str, params: Any) -> None:
    """Write the data file, then the index, each to a temporary file renamed into place (the index
    last: a reader finds an index only beside a whole data file it describes, or a mismatch)."""
    folder.mkdir(parents=True, exist_ok=True)
    leaves, treedef = jax.tree.flatten(params)
    arrays, offset = [], 0
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            for leaf in leaves:
                host = np.ascontiguousarray(np.asarray(leaf))
                pad = -offset % _ALIGN
                f.write(b"\0" * pad)
                offset += pad
                raw = host.view(np.uint8).reshape(-1)
                f.write(raw)
                arrays.append([offset, list(host.shape), host.dtype.str, zlib.crc32(raw)])
                offset += raw.size
        os.replace(tmp, folder / f"{name}.bin")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    index = {"format": FORMAT, "bytes": offset, "arrays": arrays, "treedef": pickle.dumps(treedef).hex()}
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(index, f)
    os.replace(tmp, folder / f"{name}.json")
    prefix = name.rsplit("-", 1)[0] + "-"
    for other in folder.iterdir():  # the same model's entries for other settings or sources: one kept
        if other.name.startswith(prefix) and other.stem != name and not other.name.startswith("."):
            other.unlink(missing_ok=True)
    logger.info("converted weights cached in %s (%.0f MB)", folder / f"{name}.bin", offset / 1e6)
