"""Serving while the rest compile (`compile_in_background`, on by default for `jaxserve serve`).

A cold start compiles one executable per token bucket (and variant), ~7 s each for the default model
on 2 CPU cores. With this on, start-up compiles only the opening buckets (`buckets.opening_buckets`:
the 1-token bucket and the smallest holding a decode of every row), the engine is ready (the
server's /health answers 200), and a thread compiles the others one token bucket at a time, largest
benefit first (`buckets.background_order`). Until a bucket is ready its work runs as steps of ready
ones: the scheduler's token budget is the largest ready bucket (a long prompt is chunked to it) and
each step takes the smallest ready bucket that holds it (`StepContext.ready_tokens`). Chunking does
not change what a step computes, so outputs are the same, only slower.

A token bucket becomes ready whole: every variant's executable of that size (plain, multi-step,
prompt scoring) is in the runner's table first, then the step context's ready tuple is replaced,
then the scheduler's budget raised; both only grow, so a step scheduled under an older budget
always fits a ready bucket. Each executable is built once, through `ExecutableTable.get` (which
loads it from the executable store when it is there), and the thread's compiles count as planned
(`compiles_after_warmup` stays 0). The thread stops between executables when the runner closes
(`stop`: a compile under way finishes first, its result dropped). Off with more than one process (every process
must be able to run the bucket the leader picks) and with speculative decoding (its adaptive policy
times steps of every bucket at start-up).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from jaxserve.engine.buckets import background_order, opening_buckets
from jaxserve.runner.compilation import CompileCounter

logger = logging.getLogger(__name__)


class BackgroundCompile:
    """The token buckets of a runner not compiled at start-up, compiled on a thread of their own.

    `keys`: every executable the warm-up plans (each variant's, by token bucket `key[0]`);
    `on_ready(tokens)`: called with the largest ready token bucket each time one becomes ready (the
    scheduler's budget cap)."""

    def __init__(self, runner, keys: list[tuple], on_ready: Callable[[int], None]):
        self.runner = runner
        self.groups: dict[int, list[tuple]] = {}
        for key in keys:
            self.groups.setdefault(key[0], []).append(key)
        counts = tuple(sorted(self.groups))
        self.opening = tuple(t for t in opening_buckets(runner.buckets) if t in self.groups)
        self.order = background_order(counts, self.opening)
        self.on_ready = on_ready
        self.ready: tuple[int, ...] = ()
        self.compile_seconds = 0.0  # building the executables of ready buckets (the opening ones too)
        self.all_ready_at: float | None = None  # time.perf_counter() when the last bucket became ready
        self.failed: list[tuple[int, str]] = []  # (token bucket, error): it stays unready
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def total(self) -> int:
        return len(self.groups)

    def open(self) -> list[tuple]:
        """Compile (or load) the opening buckets' executables and run each once, on this thread;
        steps keep to them from now on. Returns their keys."""
        keys = [k for t in self.opening for k in self.groups[t]]
        start = time.perf_counter()
        self.runner.warm_up(keys)
        self.compile_seconds += time.perf_counter() - start
        for t in self.opening:
            self._publish(t)
        return keys

    def start(self) -> None:
        """Compile the other buckets on a thread (daemon: a process exiting does not wait for it)."""
        if self.order and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxserve-background-compile", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Compile nothing more; wait for a compile under way to end (its executable is dropped
        with the runner's table)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the thread is done (every bucket ready, or stopped); whether it is."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running

    def _run(self) -> None:
        CompileCounter.mark_background()  # planned compiles: not in `compiles_after_warmup`
        for tokens in self.order:
            if self._stop.is_set():
                return
            self._build(tokens)
        if not self._stop.is_set():
            self.all_ready_at = time.perf_counter()
            logger.info(
                "background compilation done: %d of %d token buckets ready (%.1f s compiling in all)%s",
                len(self.ready),
                self.total,
                self.compile_seconds,
                "".join(f"; bucket {t} failed: {err}" for t, err in self.failed),
            )

    def _build(self, tokens: int) -> None:
        """Every executable of token bucket `tokens`, then the bucket is ready (or logged as failed)."""
        start = time.perf_counter()
        try:
            for key in self.groups[tokens]:
                if self._stop.is_set():
                    return
                self.runner.table.get(key)
        except Exception as err:  # noqa: BLE001 - the engine serves on with the ready buckets
            if not self._stop.is_set():
                logger.warning(
                    "token bucket %d failed to compile in the background (%s: %s)", tokens, type(err).__name__, err
                )
                self.failed.append((tokens, f"{type(err).__name__}: {err}"))
            return
        if self._stop.is_set():
            return
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        self._publish(tokens)
        logger.info("token bucket %d ready (%.1f s; %d of %d ready)", tokens, seconds, len(self.ready), self.total)

    def _publish(self, tokens: int) -> None:
        """Token bucket `tokens` is usable: the step context's ready tuple first, then the budget."""
        with self._lock:
            self.ready = tuple(sorted({*self.ready, tokens}))
            self.runner.ctx.ready_tokens = None if len(self.ready) == self.total else self.ready
            self.on_ready(self.ready[-1])

    def stats(self) -> dict:
        return dict(
            buckets_ready=len(self.ready),
            buckets_total=self.total,
            bucket_compile_seconds=self.compile_seconds,
        )
