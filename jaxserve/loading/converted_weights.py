"""Weights converted at load, kept in jaxserve's cache and mapped on the next start.

A GGUF file's weights are dequantized (or requantized) at every load: for the default model's Q4_1
file that was most of the ~5 s to the weights placed, and the larger share of a warm start once the
executables come from the store. A safetensors checkpoint's linear weights are transposed into
jaxserve's layout, which on a CPU costs more than reading them (`enabled`). The first load writes the converted host arrays into one file under
`~/.cache/jaxserve/weights` (`$JAXSERVE_CACHE`) with an index holding each array's place, shape, dtype,
partition spec and CRC-32, and the params' pytree definition; the next load maps that file, checks
every array's CRC-32 and places it on its sharding. A missing, truncated or damaged file is converted
again (one warning line) and rewritten: never served. The key holds the GGUF file's identity (path,
size, modification time: the model directory's name) or the safetensors files', jaxserve's source hash, the model config and
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
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

FORMAT = 1
_ALIGN = 64  # each array starts on a 64-byte boundary of the file


ENV = "JAXSERVE_WEIGHTS_CACHE"  # "0": converted weights are not cached (the test suite's default)


MAX_ENV = "JAXSERVE_WEIGHTS_CACHE_MAX"  # the largest safetensors checkpoint whose laid-out weights are kept
DEFAULT_MAX_BYTES = 8 << 30


def enabled(model_dir: str) -> bool:
    """Whether this model's weights are converted at load and so kept, unless $JAXSERVE_WEIGHTS_CACHE=0:
    a GGUF file's (dequantized or requantized), and a safetensors checkpoint's of at most
    $JAXSERVE_WEIGHTS_CACHE_MAX bytes (8 GiB): its linear weights are transposed into jaxserve's
    [in, out] layout at load, which on a CPU took longer than reading them (a 1.24 B-parameter bf16
    checkpoint: 5-8 s to lay out against 1.6-3.4 s to read on 2 cores). A copy the size of the
    checkpoint is the price, hence the bound (a larger model's cache would cost more disk than its
    load saves time)."""
    from jaxserve.loading.gguf_model import gguf_source

    off = os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off")
    if off:
        return False
    if gguf_source(model_dir) is not None:
        return True
    if jax.process_count() > 1:  # each process holds only its shards: no process could write the whole copy
        return False
    files = checkpoint_files(model_dir)
    limit = int(os.environ.get(MAX_ENV) or DEFAULT_MAX_BYTES)
    return bool(files) and sum(os.path.getsize(f) for f in files) <= limit


def checkpoint_files(model_dir: str) -> list[str]:
    """A safetensors checkpoint's weight files ([] for a directory without)."""
    from jaxserve.errors import ModelLoadError
    from jaxserve.loading.checkpoint import safetensors_files

    try:
        return safetensors_files(model_dir)
    except (ModelLoadError, OSError):
        return []


def _files_identity(model_dir: str) -> list:
    """Each weight file's path, size and modification time: a rewritten checkpoint is a new entry (a
    GGUF-backed directory's name already says which file it stands for)."""
    out = []
    for path in checkpoint_files(model_dir):
        st = os.stat(path)
        out.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
    return out


def cache_dir() -> Path:
    base = os.environ.get("JAXSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
    return Path(base) / "weights"


def weights_key(model_dir: str, parts: dict) -> str:
    """The entry's name: the model directory's name and a hash of the weight files' identity (a GGUF
    file's is in the directory's name), the settings, config and jaxserve's source."""
    from jaxserve.runner.executable_keys import describe, source_hash

    material = json.dumps(
        {
            "format": FORMAT,
            "source": source_hash(),
            "model_dir": os.path.abspath(model_dir),
            "files": _files_identity(model_dir),
            **describe(parts),
        },
        sort_keys=True,
    )
    return f"{Path(model_dir).name}-{hashlib.sha256(material.encode()).hexdigest()[:20]}"


def stored_dtype(model_dir: str, dtype: Any) -> Any:
    """The narrower float dtype to keep a safetensors checkpoint's laid-out weights in, when every
    tensor of its files is stored in it (bfloat16 or float16, read from their headers) and the model
    runs wider (float32 on a CPU): the values came from it, so the copy holds them exactly at half
    the size, and is cast back as it is mapped (a Llama-3.2-1B copy: 2.5 GB, not 4.9). None otherwise."""
    from jaxserve.loading.checkpoint import safetensors_dtypes

    files = checkpoint_files(model_dir)
    kinds = safetensors_dtypes(files) if files else set()
    if len(kinds) != 1:
        return None
    (kind,) = kinds
    narrow = jnp.dtype(kind)
    wide = jnp.dtype(dtype)
    floats = jnp.issubdtype(narrow, jnp.floating) and jnp.issubdtype(wide, jnp.floating)  # bfloat16's kind is "V"
    return narrow if floats and narrow.itemsize < wide.itemsize else None


def load_or_convert(model_dir: str, parts: dict, shardings: Any, convert: Callable[[], Any], stored: Any = None) -> Any:
    """The params from the cache entry for (model_dir, parts), placed on `shardings` (a pytree like the
    params'); else `convert()`, written to the cache for the next start. `stored` (`stored_dtype`):
    wider float arrays are kept in it, and cast back at load."""
    folder = cache_dir()
    if stored is not None:
        parts = {**parts, "stored_dtype": jnp.dtype(stored).name}
    name = weights_key(model_dir, parts)
    params = _load(folder, name, shardings)
    if params is not None:
        return params
    params = convert()
    try:
        _save(folder, name, params, stored)
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
        leaves = [_placed(mapped, entry, sharding) for entry, sharding in zip(index["arrays"], targets)]
    except Exception as err:  # noqa: BLE001 - anything wrong with the entry: convert again
        logger.warning("cached converted weights %s not used (%s): converting them again", data_path, err)
        return None
    logger.info("converted weights mapped from %s", data_path)
    return jax.tree.unflatten(treedef, leaves)


def _placed(mapped: np.ndarray, entry: list, sharding: Any) -> jax.Array:
    """One index entry's array from the mapped data file, its CRC-32 checked, placed on `sharding` in
    the dtype the model runs in. An array kept narrower (`stored_dtype`) is widened where it is
    placed: XLA converts it on every core into memory it allocates, where numpy's single-threaded cast
    into freshly faulted pages was most of a 1B-parameter model's load on a CPU (docs/BENCHMARKS.md)."""
    offset, shape, name, crc, *wide = entry
    dtype = jnp.dtype(name)  # by name: bfloat16's numpy .str is an opaque "<V2"
    raw = mapped[offset : offset + int(np.prod(shape)) * dtype.itemsize]
    if zlib.crc32(raw) != crc:
        raise ValueError("checksum mismatch")
    placed = jax.device_put(raw.view(dtype).reshape(shape), sharding)
    return placed.astype(jnp.dtype(wide[0])) if wide else placed


def _save(folder: Path, name: str, params: Any, stored: Any = None) -> None:
    """Write the data file, then the index, each to a temporary file renamed into place (the index
    last: a reader finds an index only beside a whole data file it describes, or a mismatch). With
    `stored`, a wider float array is written in that dtype, its own dtype's name recorded after its CRC."""
    folder.mkdir(parents=True, exist_ok=True)
    leaves, treedef = jax.tree.flatten(params)
    arrays, offset = [], 0
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            for leaf in leaves:
                host = np.ascontiguousarray(np.asarray(leaf))
                wide = []
                if stored is not None and host.dtype.kind == "f" and host.dtype.itemsize > jnp.dtype(stored).itemsize:
                    narrow = host.astype(jnp.dtype(stored))
                    if np.array_equal(narrow.astype(host.dtype), host):  # exact, as a cast copy is: else kept wide
                        wide, host = [host.dtype.name], narrow
                pad = -offset % _ALIGN
                f.write(b"\0" * pad)
                offset += pad
                raw = host.view(np.uint8).reshape(-1)
                f.write(raw)
                arrays.append([offset, list(host.shape), host.dtype.name, zlib.crc32(raw), *wide])
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
