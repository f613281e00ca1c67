"""Compiled step executables kept on disk, so that a warm start loads them instead of tracing,
lowering and compiling each again (`jaxserve compile` fills the store ahead of time; docs/startup.md).

A loaded executable skips tracing, so nothing downstream would notice a stale one: an entry is only
used when its key (`executable_keys.step_key`, everything that changes the program) matches the
engine's, compared before anything is loaded, and its payload's SHA-256 matches. A missing, stale,
truncated or corrupt entry is compiled again (one warning line) and rewritten; it never stops the
start. Entries are written to a temporary file and renamed into place, so servers starting together
on one store (a local disk or NFS) never read half a file and both come up. The store's size is
bounded: past `max_bytes` the least recently used entries go.

A loaded executable is code this process runs: the store refuses a directory that is not owned by
this user or that others can write to (and any entry file so), and `pickle` is only ever read back
after the checksum matched and from such a directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import stat
import struct
import tempfile
import time
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = b"JAXSERVE-EXECUTABLE\n"
FORMAT = 1
SUFFIX = ".jxe"
DEFAULT_MAX_BYTES = 4 * 2**30
_HEADER_LEN = struct.Struct("<Q")
_STALE_TMP_SECONDS = 3600  # a temporary file this old is a crashed writer's: removed at eviction


class UnsafeStoreError(Exception):
    """The store directory (or an entry) could be written by someone else: it is not used."""


def check_private(path: str, st: os.stat_result | None = None) -> None:
    """UnsafeStoreError unless `path` belongs to this user (or to root: an image's read-only store) and no
    group or other user can write it."""
    st = st or os.stat(path)
    if hasattr(os, "getuid") and st.st_uid not in (os.getuid(), 0):
        raise UnsafeStoreError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.getuid()}) or root")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeStoreError(f"{path} can be written by other users (mode {stat.filemode(st.st_mode)})")


@dataclasses.dataclass
class Loaded:
    """An entry read back: the serialized executable and the pytrees of its arguments and outputs."""

    blob: bytes
    in_tree: Any
    out_tree: Any
    header: dict


class ExecutableStore:
    """One directory of entries `<key hash>.jxe`: MAGIC, a length-prefixed JSON header (the key it was
    written for, the payload's size and SHA-256, what it is), then the payload (a pickle of the
    serialized executable and its pytree definitions)."""

    def __init__(self, directory: str, max_bytes: int = DEFAULT_MAX_BYTES):
        self.directory = directory
        self.max_bytes = max_bytes
        self.warnings: list[str] = []  # one line per entry that could not be used (tests read them)

    @classmethod
    def open(cls, directory: str, max_bytes: int = DEFAULT_MAX_BYTES) -> ExecutableStore | None:
        """The store at `directory` (created 0700 if missing); None, with a warning, when it is unsafe
        (someone else can write to it) or cannot be created: the engine then compiles as usual."""
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            check_private(directory)
        except (OSError, UnsafeStoreError) as err:
            logger.warning("executable store not used: %s (serialized executables are code; see docs/startup.md)", err)
            return None
        return cls(directory, max_bytes)

    def path(self, key_hash: str) -> str:
        return os.path.join(self.directory, key_hash + SUFFIX)

    # ---- reading -------------------------------------------------------------------------------
    def load(self, key_hash: str, key: dict | None, warn: bool = True) -> Loaded | None:
        """The entry for `key` (hashing to `key_hash`), or None: absent (silently), or unusable (one
        warning, and a damaged entry removed: `refuse`; the caller compiles it again). `key` None:
        whichever key the header holds (the caller compares it); `warn` False: an unusable entry is
        left to the caller's own load."""
        path = self.path(key_hash)
        unusable = self.refuse if warn else lambda path, reason: None
        try:
            with open(path, "rb") as f:
                check_private(path, os.fstat(f.fileno()))
                data = f.read()
        except FileNotFoundError:
            return None
        except (OSError, UnsafeStoreError) as err:  # unreadable, or not private: left where it is
            if warn:
                self._warn(f"executable store entry {os.path.basename(path)} not used ({err}): compiled again")
            return None
        try:
            header, payload = split_entry(data)
        except ValueError as err:
            return unusable(path, str(err))
        if key is not None and header.get("key") != key:
            return unusable(path, "written for another key (" + describe_difference(header.get("key"), key) + ")")
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            return unusable(path, "checksum mismatch")
        try:
            blob, in_tree, out_tree = pickle.loads(payload)
        except Exception as err:  # noqa: BLE001 - checksummed, so only a foreign class can fail here
            return unusable(path, f"cannot be read back ({type(err).__name__}: {err})")
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        return Loaded(blob, in_tree, out_tree, header)

    def refuse(self, path: str, reason: str) -> None:
        """Note (one warning line) that an entry is not used, and remove it: the caller compiles the
        step again, and may not store it (one read back from JAX's persistent cache is never stored),
        so a damaged entry left in place would be refused again at every start."""
        self._warn(f"executable store entry {os.path.basename(path)} not used ({reason}): compiled again")
        try:
            os.unlink(path)
        except OSError:
            pass

    def _warn(self, line: str) -> None:
        self.warnings.append(line)
        logger.warning(line)

    # ---- writing -------------------------------------------------------------------------------
    def save(self, key_hash: str, key: dict, payload_parts: tuple, about: dict) -> str | None:
        """Write an entry atomically (a temporary file renamed over the name); returns its path, or
        None when it could not be written (logged: the engine runs on without it)."""
        payload = pickle.dumps(payload_parts, protocol=pickle.HIGHEST_PROTOCOL)
        header = dict(
            format=FORMAT,
            key=key,
            sha256=hashlib.sha256(payload).hexdigest(),
            payload_bytes=len(payload),
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **about,
        )
        head = json.dumps(header, sort_keys=True).encode()
        path = self.path(key_hash)
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{key_hash[:16]}.", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(MAGIC + _HEADER_LEN.pack(len(head)) + head + payload)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as err:
            logger.warning("could not write executable store entry %s: %s", path, err)
            return None
        self.evict(keep=path)
        return path

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove the least recently used entries while the store is over `max_bytes` (never `keep`),
        and temporary files of writers that died; returns the removed paths."""
        removed, entries, now = [], [], time.time()
        for name in os.listdir(self.directory):
            full = os.path.join(self.directory, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            if name.endswith(".tmp"):
                if now - st.st_mtime > _STALE_TMP_SECONDS:
                    removed.append(full)
            elif name.endswith(SUFFIX):
                entries.append((st.st_mtime, st.st_size, full))
        total = sum(size for _, size, _ in entries)
        for _, size, full in sorted(entries):
            if total <= self.max_bytes:
                break
            if full != keep:
                removed.append(full)
                total -= size
        for full in removed:
            try:
                os.unlink(full)
            except OSError:
                pass
        return removed

    # ---- listing -------------------------------------------------------------------------------
    def entries(self) -> list[dict]:
        """One dict per entry (its header but the key, with path and bytes), most recently used first;
        an unreadable file is listed with its `error`."""
        rows = []
        for name in os.listdir(self.directory):
            if not name.endswith(SUFFIX):
                continue
            full = os.path.join(self.directory, name)
            try:
                st = os.stat(full)
                with open(full, "rb") as f:
                    head = f.read(len(MAGIC) + _HEADER_LEN.size)
                    header = (
                        json.loads(f.read(_HEADER_LEN.unpack(head[len(MAGIC) :])[0]))
                        if head[: len(MAGIC)] == MAGIC
                        else {}
                    )
                row = {k: v for k, v in header.items() if k != "key"}
                if not header:
                    row["error"] = "not an entry"
            except (OSError, ValueError, struct.error) as err:
                row, st = {"error": str(err)}, None
            row.update(path=full, bytes=st.st_size if st else 0, used=st.st_mtime if st else 0)
            rows.append(row)
        return sorted(rows, key=lambda r: -r["used"])

    def written_at_start(self, start: str) -> list[tuple[str, list]]:
        """(key hash, bucket) of each entry written by an engine of start key `start`
        (`executable_keys.start_key`)."""
        rows = [r for r in self.entries() if r.get("start") == start and r.get("bucket")]
        return [(os.path.basename(r["path"])[: -len(SUFFIX)], r["bucket"]) for r in rows]

    def total_bytes(self) -> int:
        return sum(r["bytes"] for r in self.entries())


def split_entry(data: bytes) -> tuple[dict, bytes]:
    """(header, payload) of an entry file's bytes; ValueError when it is not a whole entry."""
    if not data.startswith(MAGIC):
        raise ValueError("not an executable store entry")
    start = len(MAGIC) + _HEADER_LEN.size
    if len(data) < start:
        raise ValueError("truncated")
    (head_len,) = _HEADER_LEN.unpack(data[len(MAGIC) : start])
    try:
        header = json.loads(data[start : start + head_len])
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"damaged header ({err})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"format {header.get('format') if isinstance(header, dict) else '?'}, expected {FORMAT}")
    payload = data[start + head_len :]
    if len(payload) != header.get("payload_bytes"):
        raise ValueError(f"truncated ({len(payload)} of {header.get('payload_bytes')} payload bytes)")
    return header, payload


def describe_difference(old: Any, new: Any) -> str:
    """The first key fields that differ, for the warning line (e.g. `jax: 0.10.1 -> 0.10.2`)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return "unreadable key"
    diffs = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    shown = [f"{k}: {_short(old.get(k))} -> {_short(new.get(k))}" for k in diffs[:3]]
    return "; ".join(shown) + ("; ..." if len(diffs) > 3 else "")


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def key_hash(key: dict) -> str:
    """The entry's file name: SHA-256 of the key's canonical JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
