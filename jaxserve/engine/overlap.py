"""Async scheduling around the synchronous engine core: the one place where steps overlap and where
the step thread waits (no jax).

`EngineCore` is a state machine: `schedule()`, `execute(batch)` (dispatch, no wait) and
`update_from_output(step)`; its own `step()` runs the three in turn. `Overlap.step` runs the same
calls with a queue of in-flight steps, two deep with async scheduling: it schedules and dispatches
step N+1, then processes step N, so the host detokenizes N while the device runs N+1 (N+1's inputs
name N's samples as placeholders, resolved on the device). One deep (`--no-async-scheduling`, and
on a multi-step engine, whose runs decide the next inputs on the host) it is the core's serial step.
A speculative engine overlaps the steps that verify nothing: a step that verifies drafts is
`serial` (its acceptance decides the next inputs), processed before the next is scheduled, and the
step in flight is processed before one that may draft is scheduled (`EngineCore.needs_host_tokens`:
drafts come from the tokens on the host). Two things make the step thread wait before N+1 is
dispatched, both here:

- **Grammars.** A constrained row's next mask follows the token it sampled in N: when a constrained
  row samples in N+1, the wrapper waits for N's samples and hands them to the core
  (`advance_grammars`) before N+1 is packed; the rest of N's processing still overlaps N+1.
- **Arrivals.** With a front end feeding the core's intake from other threads (`arrivals=True`,
  AsyncLLMEngine), N+1's dispatch is held back until just before N should end (`ArrivalWindow`), and
  requests that arrive meanwhile are admitted and their first prompt chunks join N+1 in the tokens
  it left (`Scheduler.top_up`) instead of waiting a step more. A watcher thread wakes the wait when
  N ends, so nothing polls.

The same object serves `LLM.generate` (offline: no arrivals) and AsyncLLMEngine's step thread.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any

from jaxserve.engine.arrival_window import ArrivalWindow
from jaxserve.engine.in_flight import InFlightStep
from jaxserve.engine.scheduler_output import SchedulerOutput


class Overlap:
    """Drives an `EngineCore` one or two steps deep; not thread-safe (one step thread). Set
    `async_scheduling` to switch the depth between steps: a step left in flight is processed by the
    next `step()`."""

    def __init__(self, core: Any, *, arrivals: bool = False):
        self.core = core
        self.async_scheduling = core.config.async_scheduling
        # Only a front end feeding the intake from other threads (AsyncLLMEngine) holds a step back
        # for arrivals; offline, every request is added before the steps run.
        self.arrivals = arrivals
        self.arrival_window = ArrivalWindow()
        self.in_flight: collections.deque[InFlightStep] = collections.deque()
        self._watched: queue.SimpleQueue = queue.SimpleQueue()
        self._watcher: threading.Thread | None = None

    @property
    def depth(self) -> int:
        """Steps kept in flight: 2 with async scheduling on an engine whose steps may overlap."""
        return 2 if self.async_scheduling and self.core.can_overlap else 1

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a step in flight still to process."""
        return bool(self.in_flight) or self.core.has_unfinished_requests()

    def step(self) -> list:
        """Schedule and dispatch a step, and process the oldest step in flight once the queue is
        `depth` deep (at once when one deep); returns each advanced request's delta, the aborted
        requests' last deltas and the late refusals (`EngineCore.step`'s outputs)."""
        core, in_flight, depth = self.core, self.in_flight, self.depth
        outputs: list = []
        # A step left in flight when async scheduling was switched off, or one the next step's
        # scheduling needs on the host (speculation: its acceptance, or the tokens drafts come from).
        while in_flight and (len(in_flight) >= depth or in_flight[-1].serial or core.needs_host_tokens()):
            outputs += self._process(in_flight.popleft())
        batch = core.schedule()
        if in_flight and batch.rows:
            previous = in_flight[-1]
            if previous.constrained and core.samples_under_grammar(batch):
                # This step's masks follow the tokens of the one in flight; without a constrained row
                # sampling here, those grammars take their tokens at the update, as free rows do.
                core.advance_grammars(previous, previous.samples())
            elif self.arrivals:
                self._join_arrivals(batch, previous)
        started = time.perf_counter()
        step = core.execute(batch)
        if step is not None:
            self.arrival_window.dispatched(step.dispatched_at - started)
            in_flight.append(step)
        # A serial step (drafts verified) is processed now, as the core's own step would, after the
        # step before it (whose host work ran beside it on the device).
        while in_flight and (step is None or len(in_flight) >= depth or in_flight[-1].serial):
            outputs += self._process(in_flight.popleft())
        return outputs + core.take_outbox()

    def flush(self) -> list:
        """Process every step in flight now, so that every sampled token is on the host."""
        outputs: list = []
        while self.in_flight:
            outputs += self._process(self.in_flight.popleft())
        return outputs

    def close(self) -> None:
        """Drop the steps in flight (their requests are being failed or the engine closed) and stop the watcher."""
        self.in_flight.clear()
        self._watched.put(None)

    def _process(self, step: InFlightStep) -> list:
        outputs = self.core.update_from_output(step)
        self.arrival_window.done(step.bucket, step.dispatched_at, step.seen_at)
        return outputs

    # ---- holding a step back for arrivals --------------------------------------------------------
    def _join_arrivals(self, batch: SchedulerOutput, in_flight: InFlightStep) -> None:
        """Hold `batch` back until just before the step in flight should end, for requests that arrive
        meanwhile: their first prompt chunks join `batch`. Not when nobody could join, or the step's
        end cannot be estimated yet."""
        scheduler = self.core.scheduler
        if not scheduler.takes_arrivals(batch):
            return
        closes_at = self.arrival_window.closes_at(in_flight.bucket, in_flight.dispatched_at)
        if closes_at is None or not self._wait_for_arrivals(in_flight.pending, closes_at):
            return
        self.core.counters["arrivals_joined"] += len(scheduler.top_up(batch))

    def _wait_for_arrivals(self, pending: Any, until: float) -> int:
        """Admit requests as they arrive until one is admitted, `until` (time.perf_counter) passes,
        or the step `pending` is done; returns how many were admitted."""
        intake = self.core.intake
        self._watch(pending)
        while True:
            intake.wake.clear()  # before looking: whatever arrives later sets it and ends the wait below
            added = self.core.admit_arrivals()
            if added or intake.closed.is_set() or pending.is_ready():
                return added
            left = until - time.perf_counter()
            if left <= 0:
                return 0
            intake.wake.wait(left)  # set by an arrival, by the watcher when the step ends, or by close

    def _watch(self, pending: Any) -> None:
        """Set the intake's `wake` once `pending` (a dispatched step) is done, from a watcher thread: a
        wake-up every millisecond would take CPU from the step's own threads on a small host."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_steps, name="jaxserve-step-watcher", daemon=True)
            self._watcher.start()
        self._watched.put(pending)

    def _watch_steps(self) -> None:
        while (pending := self._watched.get()) is not None:
            try:
                pending.wait()
            except Exception:  # noqa: BLE001 - a failed step fails in the step thread; here it only wakes it
                pass
            self.core.intake.wake.set()
