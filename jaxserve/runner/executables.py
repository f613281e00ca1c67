"""The one table of compiled steps: every variant's executables by key ((tokens, pages) bucket and
the variant's tag), with each one's input layout, compiled ahead of time at warm-up and run once
there; a key needed later is compiled then, and counted (`unplanned_compiles`). With an executable
store attached (`attach_store`), a key is first looked up there, by a key computed without tracing,
and loaded instead of lowered and compiled (most often already loaded, since before the weights, by
`Preload`); what XLA compiled is written to it."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Iterable

from jaxserve.model.transfer import Layout
from jaxserve.runner.compilation import compile_buckets, compile_lowered, persistent_cache_bypassed, store_directory

logger = logging.getLogger(__name__)

_OBJECT_MAGIC = (b"\x7fELF", b"\xcf\xfa\xed\xfe")  # an ELF or a 64-bit Mach-O object file


def lacks_object_code(blob: bytes, platform: str) -> bool:
    """Whether a serialized executable is an XLA:CPU one without machine code: one read back from JAX's
    persistent cache serializes so (jax 0.10.2), and it loads but fails at its first run, after the
    step's KV cache was donated to it (the error surfaces asynchronously, when its outputs are
    awaited), so it must be refused before it is loaded. A compiled step's entry holds an object
    file per kernel group (~170 for a tiny llama's), so the scan stops early; an entry without any is
    read whole (~10 ms for the default model's 7 MB EAGLE-3 steps, against 1-4 s to load one)."""
    return platform == "cpu" and not any(magic in blob for magic in _OBJECT_MAGIC)


def deserialize_entry(entry: Any, devices: list) -> Any:
    """A store entry's executable, loaded onto `devices` (the ones its key names, in order): never the
    backend's default devices, since a sub-mesh executable loaded without them aborts the process."""
    from jax.experimental.serialize_executable import deserialize_and_load

    return deserialize_and_load(
        entry.blob, entry.in_tree, entry.out_tree, backend=devices[0].client, execution_devices=devices
    )


class Preload:
    """The store's entries written under this start's key (`executable_keys.start_key`: the last start
    with these settings), loaded on threads from before the weights load: XLA:CPU links a loaded step's
    code with the GIL released (1-4 s each for the default model's unrolled layers), which would
    otherwise come after the weights. The table takes one only when its whole key matches (`take`);
    an entry that cannot be used here is left to the table's own load, which warns once.

    The opening buckets' come first (`engine.buckets.opening_buckets`, guessed from the entries' token
    counts and `max_rows`): a server compiling in the background answers once they are in. With
    `opening_only` the others are left to the background thread, one at a time, as before: loading
    them on every core at once would slow the first requests served beside it."""

    def __init__(self, store: Any, start: str | None, max_rows: int = 1, opening_only: bool = False):
        from concurrent.futures import ThreadPoolExecutor

        self.store, self.start = store, start
        entries = store.written_at_start(start) if start is not None else []
        tokens = sorted({bucket[0] for _, bucket in entries})
        opening = {tokens[0], next((t for t in tokens if t >= max_rows), tokens[-1])} if tokens else set()
        entries = sorted(
            (e for e in entries if e[1][0] in opening or not opening_only), key=lambda e: (e[1][0] not in opening, e[1])
        )
        hashes = [h for h, _ in entries]
        self._futures: dict[str, Any] = {}
        if hashes:
            pool = ThreadPoolExecutor(max_workers=min(len(hashes), os.cpu_count() or 1, 8))
            self._futures = {h: pool.submit(self._load, h) for h in hashes}
            pool.shutdown(wait=False)
        logger.info("executable store %s: loading %d executables of the last start", store.directory, len(hashes))

    def _load(self, key_hash: str) -> tuple[dict, Any] | None:
        import jax

        entry = self.store.load(key_hash, None, warn=False)
        key = entry.header.get("key") if entry is not None else None
        if not isinstance(key, dict) or lacks_object_code(entry.blob, key.get("backend")):
            return None
        by_id = {d.id: d for d in jax.devices()}
        return key, deserialize_entry(entry, [by_id[i] for i in key["devices"]])

    def take(self, key_hash: str, key: dict) -> Any:
        """The executable preloaded for `key` (waiting for its load), or None: not preloaded, written
        for another key, or not loadable here."""
        future = self._futures.pop(key_hash, None)
        if future is None:
            return None
        try:
            result = future.result()
        except Exception as err:  # noqa: BLE001 - the table's own load tries again, and warns
            logger.debug("preloading %s failed (%s: %s)", key_hash, type(err).__name__, err)
            return None
        return result[1] if result is not None and result[0] == key else None

    def clear(self) -> None:
        """Drop what no key took (a changed checkpoint behind the same settings)."""
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()


def open_executable_store(settings: Any) -> Preload | None:
    """The executable store of these settings (`compilation.store_directory`) with the last such
    start's entries already loading (`Preload`: call before the weights load), or None (off, or
    refused as unsafe: the engine compiles as usual)."""
    from jaxserve.runner.executable_keys import start_key
    from jaxserve.runner.executable_store import ExecutableStore

    directory = store_directory(settings)
    store = None if directory is None else ExecutableStore.open(directory, settings.executable_store_max_size)
    if store is None:
        return None
    try:
        start = start_key(settings)
    except Exception as err:  # noqa: BLE001 - a setting that cannot be described: the table loads as before
        logger.warning("executable store: nothing preloaded (no start key: %s: %s)", type(err).__name__, err)
        start = None
    background = bool(settings.compile_in_background) and not settings.speculation  # LLMEngine._background_compile
    return Preload(store, start, settings.max_num_seqs, opening_only=background)


def attach_executable_store(runner: Any, preload: Preload | None) -> None:
    """Give the runner's executable table the store `open_executable_store` opened (None: none)."""
    from jaxserve.runner.executable_keys import step_signature

    if preload is not None:
        runner.table.attach_store(preload, lambda key: step_signature(runner, key))


class ExecutableTable:
    def __init__(self, lower: Callable[[tuple], tuple[Any, Layout]], compiler_options: dict, platform: str):
        self._lower = lower  # key -> (lowered step, its inputs' layout)
        self.compiler_options = compiler_options
        self.platform = platform
        self.executables: dict[tuple, Any] = {}
        self.layouts: dict[tuple, Layout] = {}
        self.unplanned_compiles = 0  # keys that were not in the warmed table
        # Calls that ran an executable for the first time: on a CPU such a call takes ~15 ms more than
        # the next ones (measured), so timings of those steps are not representative.
        self.first_runs = 0
        self.ran: set[tuple] = set()
        self.warmed = False  # compile_all ran: a compile after it was not foreseen (--enforce-eager: none ran)
        self.store: Any = None  # executable_store.ExecutableStore (attach_store)
        self.preload: Preload | None = None  # entries loading since before the weights (attach_store)
        self.preloaded: list[tuple] = []  # keys of `loaded` taken from the preload
        # With a store: compile bypassing JAX's persistent cache, so that every compile is stored
        # (`jaxserve compile`). Otherwise a step JAX's cache holds is served from there and not stored
        # (its executable serializes broken on XLA:CPU), as fast as before the store when only the
        # source changed (a new key) but not the program.
        self.fresh_compiles = False
        self._signature: Callable[[tuple], Any] | None = None  # key -> executable_keys.StepSignature
        self._signatures: dict[tuple, Any] = {}
        self.loaded: list[tuple[tuple, float]] = []  # (key, seconds) of each executable loaded from the store
        self.stored: list[tuple[tuple, float, str]] = []  # (key, compile seconds, path) of each one written
        self.compiled: list[tuple[tuple, float]] = []  # (key, seconds) of each one compiled here (not loaded)
        # Held while a key missing from the table is loaded or compiled (`get`): the background
        # compiler (runner/background_compile.py) and a step needing an unplanned key never build one twice.
        self._building = threading.RLock()

    def attach_store(self, preload: Preload, signature: Callable[[tuple], Any]) -> None:
        """Load executables from the preload's store (by `signature(key)`, computed without tracing),
        taking those it already loaded, before compiling them, and write what is compiled to it."""
        self.store, self.preload, self._signature = preload.store, preload, signature

    def __len__(self) -> int:
        return len(self.executables)

    def lower(self, key: tuple) -> Any:
        lowered, self.layouts[key] = self._lower(key)
        return lowered

    def get(self, key: tuple, planned: bool = True) -> Any:
        """Key's executable, compiled now if it is not yet (`planned` False: counted and logged as a
        compile the warm-up did not foresee)."""
        executable = self.executables.get(key)
        if executable is not None:
            return executable
        with self._building:
            executable = self.executables.get(key)  # built meanwhile by another thread
            if executable is not None:
                return executable
            if not planned:
                self.unplanned_compiles += 1
                logger.log(logging.WARNING if self.warmed else logging.INFO, "compiling unplanned step %s", key)
            executable = self._load(key)
            if executable is None:
                lowered = self.lower(key)
                start = time.perf_counter()
                with persistent_cache_bypassed(self.store is not None and self.fresh_compiles):
                    executable, compiled = compile_lowered(lowered, self.compiler_options)
                self.compiled.append((key, time.perf_counter() - start))
                self._save(key, executable, time.perf_counter() - start, compiled)
            self.executables[key] = executable  # in place whole: a reader sees it or not
        return executable

    def layout(self, key: tuple) -> Layout:
        """Key's input layout (lowering it, and so compiling it unplanned, if need be)."""
        if key not in self.layouts:
            self.get(key, planned=False)
        return self.layouts[key]

    def first_run(self, key: tuple) -> None:
        """Note a call of key's executable (its first: counted in `first_runs`)."""
        if key not in self.ran:
            self.ran.add(key)
            self.first_runs += 1

    def compile_all(self, keys: Iterable[tuple], progress: bool = True) -> list[tuple[tuple, float]]:
        """Compile the keys not compiled yet (`compilation.compile_buckets`); (key, seconds) of each."""
        self.warmed = True
        keys = [k for k in keys if k not in self.executables]
        if self.store is not None and keys:
            # XLA links a loaded executable's code with the GIL released (1-4 s for a step of the default
            # model's unrolled layers on a shared CPU core), so one thread per core loads them side by
            # side; on the saturated 2-core machine measured this gained nothing (docs/BENCHMARKS.md).
            from concurrent.futures import ThreadPoolExecutor

            start, loaded = time.perf_counter(), 0
            with ThreadPoolExecutor(max_workers=min(len(keys), os.cpu_count() or 1, 8)) as pool:
                for key, executable in zip(keys, pool.map(self._load, keys)):
                    if executable is not None:
                        self.executables[key] = executable
                        loaded += 1
            keys = [k for k in keys if k not in self.executables]
            logger.info(
                "executable store %s: %d step executables loaded in %.2fs, %d to compile",
                self.store.directory,
                loaded,
                time.perf_counter() - start,
                len(keys),
            )
        logger.info("compiling %d step buckets: %s", len(keys), keys)
        timings = []
        with persistent_cache_bypassed(self.store is not None and self.fresh_compiles):
            compiled = compile_buckets(keys, self.lower, self.compiler_options, self.platform, progress)
        for key, executable, seconds, compiled_here in compiled:
            self.executables[key] = executable
            self.compiled.append((key, seconds))
            timings.append((key, seconds))
            logger.info("bucket %s compiled in %.2fs", key, seconds)
            self._save(key, executable, seconds, compiled_here)
        return timings

    # ---- the executable store --------------------------------------------------------------------
    def _load(self, key: tuple) -> Any:
        """Key's executable from the store (its input layout recorded), or None: no store, no entry,
        or an entry that cannot be used (the store warns; the caller compiles)."""
        if self.store is None:
            return None
        start = time.perf_counter()
        try:
            signature = self._signatures[key] = self._signature(key)
        except Exception as err:  # noqa: BLE001 - a key that cannot be described is compiled, not loaded
            logger.warning("no executable store key for %s (%s: %s): compiling it", key, type(err).__name__, err)
            return None
        executable = self.preload.take(signature.key_hash, signature.key) if self.preload is not None else None
        if executable is not None:
            self.layouts[key] = signature.layout
            self.loaded.append((key, time.perf_counter() - start))  # the wait for it, if any
            self.preloaded.append(key)
            logger.info("bucket %s loaded from the executable store (preloaded)", key)
            return executable
        entry = self.store.load(signature.key_hash, signature.key)
        if entry is None:
            return None
        if lacks_object_code(entry.blob, self.platform):
            self.store.refuse(self.store.path(signature.key_hash), "no object code: it would fail at its first run")
            return None
        try:
            executable = deserialize_entry(entry, signature.devices)
        except Exception as err:  # noqa: BLE001 - e.g. XLA refusing the code: compiled instead
            self.store.refuse(self.store.path(signature.key_hash), f"{type(err).__name__}: {err}")
            return None
        self.layouts[key] = signature.layout
        seconds = time.perf_counter() - start
        self.loaded.append((key, seconds))
        logger.info("bucket %s loaded from the executable store in %.3fs", key, seconds)
        return executable

    def _save(self, key: tuple, executable: Any, seconds: float, compiled: bool) -> None:
        """Write an executable XLA `compiled` in this process's call to the store (when its key's layout
        and devices are the ones it was compiled with). Not one from JAX's persistent cache, whose
        executables serialize without their code on XLA:CPU (`compilation.compile_lowered`,
        `persistent_cache_bypassed`, `fresh_compiles`)."""
        if self.store is None:
            return
        if not compiled:
            logger.info(
                "step %s not stored: it came from JAX's persistent or in-memory cache (`jaxserve compile` stores it)",
                key,
            )
            return
        from jax.experimental.serialize_executable import serialize

        try:
            signature = self._signatures.get(key) or self._signature(key)
        except Exception as err:  # noqa: BLE001
            logger.warning("step %s not stored: no key (%s: %s)", key, type(err).__name__, err)
            return
        if signature.layout != self.layouts.get(key):
            logger.warning("step %s not stored: its key's input layout differs from the compiled one", key)
            return
        compiled_on = getattr(getattr(executable._executable, "_unloaded_executable", None), "device_list", None)
        if compiled_on is not None and [d.id for d in compiled_on] != [d.id for d in signature.devices]:
            logger.warning("step %s not stored: compiled for devices %s, its key names others", key, compiled_on)
            return
        try:
            parts = serialize(executable)
        except (ValueError, NotImplementedError) as err:  # e.g. a program with const_args
            logger.warning("step %s not stored: %s", key, err)
            return
        if lacks_object_code(parts[0], self.platform):
            logger.warning("step %s not stored: it serialized without object code", key)
            return
        m = signature.key.get("model") or {}
        about = dict(
            variant=signature.key["variant"].rsplit(".", 1)[-1],
            bucket=list(key),
            compile_seconds=round(seconds, 3),
            start=self.preload.start if self.preload is not None else None,
            model=f"{m.get('architecture')} {m.get('num_layers')}x{m.get('hidden_size')}",
        )
        path = self.store.save(signature.key_hash, signature.key, parts, about)
        if path is not None:
            self.stored.append((key, seconds, path))

    def clear(self) -> None:
        if self.preload is not None:
            self.preload.clear()
        self.executables.clear()
        self.layouts.clear()
        self.ran.clear()
