"""Timing the engine's compiled steps below `LLM.generate` (benchmark scripts share this).

`capture_step` runs `ModelRunner.execute` and keeps the exact executable and arguments the
runner hands XLA for those rows, with the arguments made device-resident; `time_step` then calls
that executable directly, so a timing measures the compiled step (optionally plus the fetch of its
samples, as a real decode loop must do to feed tokens back) without the runner's host packing.

    from jaxserve.runner.step_timing import capture_step, time_step
    step = capture_step(llm.runner, rows)
    seconds = time_step(llm.runner, step, steps=16, sync=True)      # per-step list
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence


@dataclasses.dataclass
class CapturedStep:
    """The compiled step of one bucket and its (device-resident) arguments after params and cache."""

    shape: tuple
    executable: Any
    inputs: tuple


def capture_step(runner, rows: Sequence) -> CapturedStep:
    """Run `runner.execute_rows(rows)` twice (the first compiles the bucket if needed) and capture what the
    second hands its executable."""
    import jax

    runner.execute_rows(rows)
    captured: dict[str, Any] = {}
    executables = runner.table.executables
    originals = dict(executables)
    for shape, exe in originals.items():

        def recorder(*a, _exe=exe, _shape=shape):
            captured["shape"], captured["args"] = _shape, a
            return _exe(*a)

        executables[shape] = recorder
    try:
        runner.execute_rows(rows)
    finally:
        executables.update(originals)
    shape = captured["shape"]
    return CapturedStep(shape, executables[shape], jax.device_put(captured["args"][2:]))


def time_step(runner, step: CapturedStep, steps: int, sync: bool = True) -> list[float]:
    """Seconds per call of the captured executable on the runner's params and (donated) cache.

    sync=True: every call's samples are fetched to the host before the next call (a decode loop),
    and the list holds each call's time. sync=False: the calls are queued back to back and only the
    last is waited for (the device-time floor); the list holds the mean, once per call."""
    import jax

    args = list(step.inputs)

    def call():
        # A plain step returns (samples, cache, carried samples): the carried ones feed the next call,
        # as the runner's next step would take them (donated buffers are never reused).
        out, runner.cache, *carried = step.executable(runner.params, runner.cache, *args)
        if carried:
            args[0] = runner.carried = carried[0]
        return out

    if sync:
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            jax.device_get(call())
            times.append(time.perf_counter() - t)
        return times
    t = time.perf_counter()
    for _ in range(steps):
        out = call()
    jax.block_until_ready(out)
    return [(time.perf_counter() - t) / steps] * steps


def time_calls(fn: Callable[[], Any], steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `fn` (which must wait for its own result)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times
