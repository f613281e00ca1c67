"""Open a GGUF file (llama.cpp's format) with the `gguf` library and read its metadata as plain Python.

The library's reader memory-maps the file, so opening it reads only the header; tensors are read when
their data is touched. Metadata values come back as str, int, float, bool or lists of them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jaxserve.errors import ModelLoadError

GGUF_SUFFIX = ".gguf"


def find_gguf(path: str | os.PathLike) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf file of a directory (None when the
    directory holds none). A directory with several is an error naming them, since which to serve is
    the user's choice."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == GGUF_SUFFIX else None
    if not p.is_dir():
        return None
    files = sorted(f for f in p.iterdir() if f.suffix.lower() == GGUF_SUFFIX and f.is_file())
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ModelLoadError(f"{p} holds several GGUF files ({names}); name one: --model {files[0]}")
    return files[0] if files else None


def open_gguf(path: str | os.PathLike) -> Any:
    """A `gguf.GGUFReader` over `path`, or a ModelLoadError saying what is wrong with the file."""
    try:
        from gguf import GGUFReader
    except ImportError:  # a declared dependency; only a broken install lacks it
        raise ModelLoadError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as err:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({err})") from None


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key-value pair of the file's header but the format's own (`GGUF.*`), as Python values."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
