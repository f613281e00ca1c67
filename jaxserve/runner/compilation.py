"""The step executables' compiler options, the persistent compilation cache, a counter of XLA
compilations, and releasing compiled code.

Every step shape comes from a small fixed bucket table compiled at start-up (`engine/buckets.py`, host
code without jax, re-exported here); the counter lets tests (and /metrics) prove that nothing compiles
afterwards.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from typing import Any, Callable

import jax


logger = logging.getLogger(__name__)

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # every compile request (cache hits too)
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def step_compiler_options(platform: str) -> dict[str, str]:
    """XLA options of the engine's step executables: on CPU, the memory-optimized scheduler.

    XLA's default CPU scheduler hoists every weight conversion of a step to its start, so with int8
    (or bfloat16) weights all layers' converted weights are alive at once (425 MB of temporaries for
    the SmolLM2-135M shape); the memory-optimized one converts each weight just before its matmul
    (one weight, 3.5 MB, that stays in cache), which also ran a 30-layer chain of those int8 matmuls
    about 2x faster. Float32 steps convert nothing and are unaffected."""
    if platform == "cpu":
        return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    return {}


class CompileCounter:
    """Counts executables requested in this process (`requests`: a jit-cache miss, whether XLA then
    compiles or loads it from the persistent cache) and those XLA actually compiled (`compiles()`)."""

    _lock = threading.Lock()
    _local = threading.local()  # requests and cache hits of the current thread (`thread_requests`)
    _installed = False
    requests = 0
    cache_hits = 0
    background_requests = 0  # of `requests`, those made on a thread marked `mark_background`

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            cls._installed = True

        def on_duration(event: str, duration: float, **kwargs) -> None:
            if event == _COMPILE_EVENT:
                cls._local.requests = getattr(cls._local, "requests", 0) + 1
                with cls._lock:
                    cls.requests += 1
                    cls.background_requests += getattr(cls._local, "background", False)

        def on_event(event: str, **kwargs) -> None:
            if event == _CACHE_HIT_EVENT:
                cls._local.hits = getattr(cls._local, "hits", 0) + 1
                with cls._lock:
                    cls.cache_hits += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)

    @classmethod
    def mark_background(cls) -> None:
        """Count the calling thread's requests as planned background compiles
        (runner/background_compile.py), not in `foreground`."""
        cls._local.background = True

    @classmethod
    def foreground(cls) -> int:
        """Requests made outside background compile threads: what `compiles_after_warmup` counts."""
        with cls._lock:
            return cls.requests - cls.background_requests

    @classmethod
    def thread_requests(cls) -> int:
        """Executables requested on the calling thread (compiled, or read from the persistent cache)."""
        return getattr(cls._local, "requests", 0)

    @classmethod
    def thread_cache_hits(cls) -> int:
        """Persistent-cache hits of compiles made on the calling thread."""
        return getattr(cls._local, "hits", 0)

    @classmethod
    def compiles(cls) -> int:
        """Compilations XLA actually performed (requests not served from the persistent cache)."""
        return cls.requests - cls.cache_hits


def release_compiled_code() -> None:
    """Free the code of executables that nothing holds any more (call after dropping an engine's).

    Dropping every reference to a compiled step is not enough: JAX's in-memory compilation cache keeps
    each executable it built, keyed weakly on the lowered module, which JAX's lowering cache keeps
    alive, so on a CPU the code stayed mapped after an engine was gone (measured: a tiny engine's
    ~2,900 mappings all still there after `del` and `gc.collect()`). Emptying that cache releases
    them; an executable held elsewhere (another engine's compiled steps, a jitted function's own call
    cache) is unaffected, so another engine in the process compiles nothing again. (`jax.clear_caches()`
    would free a few more mappings, but it also empties every jitted function's call cache, and the
    other engines would compile their page copies again.)"""
    from jax.extend.backend import clear_in_memory_compilation_cache

    gc.collect()  # executables in reference cycles
    clear_in_memory_compilation_cache()
    gc.collect()


def count_memory_mappings() -> int | None:
    """Lines of /proc/self/maps: this process's memory mappings (None off Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


MAPPINGS_WARN_FRACTION = 0.5


def check_memory_mappings(platform: str) -> float | None:
    """Warn when this process holds over half the kernel's limit of memory mappings; returns the fraction.

    XLA:CPU maps each compiled executable's JIT code in a few hundred pieces (~300 for a step of the
    default model), and Linux caps a process at vm.max_map_count mappings (65530 by default). Past
    it, the next compilation fails inside LLVM ("Cannot allocate memory") and aborts the process, so
    a CPU engine with many buckets (speculation multiplies them), or several engines in one process,
    should know before that. Accelerator backends are unaffected."""
    if platform != "cpu":
        return None
    try:
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except OSError:  # not Linux
        return None
    fraction = used / limit
    if fraction > MAPPINGS_WARN_FRACTION:
        logger.warning(
            "this process holds %d memory mappings, %.0f%% of vm.max_map_count=%d: XLA:CPU maps every "
            "compiled executable's code, and compiling past the limit aborts the process. Raise it "
            "(sysctl -w vm.max_map_count=262144), or compile fewer buckets (max_num_seqs, "
            "max_model_len, num_speculative_tokens) or engines per process",
            used,
            100 * fraction,
            limit,
        )
    return fraction


CACHE_DIR_ENV = "JAXSERVE_COMPILATION_CACHE_DIR"
STORE_ENV = "JAXSERVE_EXECUTABLE_STORE"  # "0": the executable store is off unless a caller opens one


def default_cache_dir() -> str:
    """The root of jaxserve's compiled-code caches: $JAXSERVE_COMPILATION_CACHE_DIR, else
    $XDG_CACHE_HOME/jaxserve or ~/.cache/jaxserve."""
    if os.environ.get(CACHE_DIR_ENV):
        return os.environ[CACHE_DIR_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxserve")


def cache_root(cache_dir: str | None, enabled: bool = True) -> str | None:
    """The caches' root directory for the `compilation_cache_dir` setting; None when disabled ("",
    "none", "off", or `compilation_cache` false)."""
    if not enabled or (cache_dir is not None and cache_dir.lower() in ("", "none", "off")):
        return None
    return cache_dir or default_cache_dir()


def enable_compilation_cache(cache_dir: str | None, enabled: bool = True) -> str | None:
    """Turn on JAX's persistent cache in `<root>/xla/jax-<version>-<backend>`; returns its path
    (None: disabled, see `cache_root`).

    JAX's cache key already covers the jaxlib version and device kind; the versioned subdirectory
    just keeps stale entries of other versions out of the way.
    """
    root = cache_root(cache_dir, enabled)
    if root is None:
        return None
    path = os.path.join(root, "xla", f"jax-{jax.__version__}-{jax.default_backend()}")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def store_directory(settings: Any) -> str | None:
    """Where the engine's executable store is (`<root>/executables`), or None when it is off: caches
    disabled, `executable_store` false, $JAXSERVE_EXECUTABLE_STORE=0, or a multi-process job (each
    process would need its own devices' entries; not supported yet)."""
    root = cache_root(settings.compilation_cache_dir, settings.compilation_cache)
    if root is None or not settings.executable_store or settings.num_processes > 1:
        return None
    if os.environ.get(STORE_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    return os.path.join(root, "executables")


_bypass_lock = threading.Lock()
_bypass = {"depth": 0, "saved": None}  # nested or concurrent bypasses: the first saves, the last restores


@contextlib.contextmanager
def persistent_cache_bypassed(bypass: bool = True):
    """Compile without JAX's persistent cache while in this block (every thread).

    For the executable store: on XLA:CPU, an executable read from the persistent cache serializes
    to bytes that load but fail at their first call ("Function ... not found", jax 0.10.2), so what
    the store writes must be a real compile. jax reads whether the cache is used once per process
    (`compilation_cache.is_cache_used`), so this flips that private flag; where it is missing (another
    jax), nothing is bypassed and `compile_lowered` reports the hits, which are then not stored."""
    try:
        from jax._src import compilation_cache as cc

        cc.is_cache_used(jax.devices()[0].client)  # the once-per-process check, settled first
        cc._cache_used  # noqa: B018 - present in this jax
    except Exception:  # noqa: BLE001 - a jax without these internals
        bypass = False
    if not bypass:
        yield
        return
    with _bypass_lock:
        if _bypass["depth"] == 0:
            _bypass["saved"] = cc._cache_used
        _bypass["depth"] += 1
        cc._cache_used = False
    try:
        yield
    finally:
        with _bypass_lock:
            _bypass["depth"] -= 1
            if _bypass["depth"] == 0:
                cc._cache_used = _bypass["saved"]


def compile_lowered(lowered: Any, options: dict[str, str]) -> tuple[Any, bool]:
    """(executable, whether XLA compiled it in this call) of a lowered step.

    Only such an executable may be stored (`executables.ExecutableTable`): on XLA:CPU one read back from
    JAX's persistent cache serializes without its object code, and loaded it fails at its first run
    ("Function ... not found", jax 0.10.2). JAX's in-memory cache (keyed on the lowered module, which
    JAX's lowering cache shares between engines of one program in a process) returns an executable
    built earlier without recording any event, so where it came from is unknown: not compiled here."""
    CompileCounter.install()
    requests, hits = CompileCounter.thread_requests(), CompileCounter.thread_cache_hits()
    executable = lowered.compile(options)
    return executable, CompileCounter.thread_requests() > requests and CompileCounter.thread_cache_hits() == hits


def compile_buckets(
    shapes: list[tuple], lower: Callable[[tuple], Any], options: dict[str, str], platform: str, progress: bool = True
) -> list[tuple[tuple, Any, float, bool]]:
    """(shape, executable, seconds, compiled in this call: `compile_lowered`) of each bucket, lowered
    by `lower(shape)`.

    Tracing holds the GIL, so buckets are lowered one by one, each compiled meanwhile on a pool.
    XLA:CPU already spreads one compile over every core (its codegen is split), so on a CPU the
    pool has one thread: two compiles at once on 2 cores started ~6 s slower (docs/BENCHMARKS.md,
    "One compile at a time on a CPU"). Elsewhere it has one thread per core."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    def compile_one(shape, lowered):
        start = time.perf_counter()
        executable, compiled = compile_lowered(lowered, options)
        return shape, executable, time.perf_counter() - start, compiled

    workers = 1 if platform == "cpu" else (os.cpu_count() or 1)
    with (
        ThreadPoolExecutor(max_workers=workers) as pool,
        tqdm(total=len(shapes), desc="compiling step buckets", disable=not progress, unit="bucket") as bar,
    ):
        futures = []
        for shape in shapes:
            future = pool.submit(compile_one, shape, lower(shape))
            future.add_done_callback(lambda _: bar.update(1))
            futures.append(future)
        return [f.result() for f in futures]
