"""The project's text corpus: the running interpreter's standard-library Python sources.

There is no dataset hub here, so the tokenizers and the default model are made from the stdlib.
Files come in sorted path order; a fixed 5% of them, chosen by a hash of the path (so the split does
not move when files are added or removed), is held out for evaluation.
"""

from __future__ import annotations

import hashlib
import os
import re
import sysconfig
from pathlib import Path
from typing import Iterator

HELDOUT_PERCENT = 5
SPLITS = ("all", "train", "heldout")


def stdlib_files() -> list[tuple[str, Path]]:
    """(path relative to the stdlib root, absolute path) of every *.py file, sorted by the former."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Third-party packages are not part of the corpus, and walking them is most of the cost.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        rel = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                key = name if rel == "." else Path(rel, name).as_posix()
                files.append((key, Path(dirpath, name)))
    return sorted(files)


def is_heldout(key: str) -> bool:
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def iter_texts(split: str = "all", max_bytes: int | None = None) -> Iterator[tuple[str, str]]:
    """(key, text) of the UTF-8 files of `split`; with `max_bytes`, stop after that many bytes,
    cutting the last file at a line end."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    budget = max_bytes
    for key, path in stdlib_files():
        if split != "all" and is_heldout(key) != (split == "heldout"):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a few test fixtures are deliberately latin-1 / koi8-r
        if budget is not None:
            n = len(text.encode("utf-8"))
            if n > budget:
                kept, used = [], 0
                for line in text.splitlines(keepends=True):
                    ln = len(line.encode("utf-8"))
                    if used + ln > budget:
                        break
                    kept.append(line)
                    used += ln
                if kept:
                    yield key, "".join(kept)
                return
            budget -= n
        yield key, text
        if budget is not None and budget <= 0:
            return


def functions_in(text: str, min_lines: int, max_lines: int) -> list[str]:
    """Source of the top-level `def`s in `text` that are min_lines..max_lines long: a function ends at
    the next line that starts unindented (trailing blank lines dropped)."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if not re.match(r"def \w+\(", line):
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j] and not lines[j][0].isspace()), len(lines))
        body = lines[i:end]
        while body and not body[-1].strip():
            body.pop()
        if min_lines <= len(body) <= max_lines:
            found.append("\n".join(body))
    return found


def top_level_functions(split: str, min_lines: int, max_lines: int) -> list[str]:
    """functions_in over every file of `split`, in file order."""
    return [f for _, text in iter_texts(split) for f in functions_in(text, min_lines, max_lines)]
