"""A step the core dispatched and has not processed yet, with one record per row (no jax).

`EngineCore.execute` makes it and `EngineCore.update_from_output` consumes it; the overlap wrapper
(`engine/overlap.py`) only keeps it in its queue, reads its timing and, for a grammar's next mask,
its samples. Each row's record says what processing the step still owes that row, so nothing is
kept in lists beside the batch.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jaxserve.engine.scheduler_output import ScheduledRow, SchedulerOutput


@dataclasses.dataclass(slots=True)
class DispatchedRow:
    """One row of a dispatched step: what its update still has to do."""

    row: ScheduledRow
    # Prompt logprobs: the prompt token after each computed position (what its logits are scored against).
    targets: list[int] | None = None
    # A plain step's sampling row: the output index whose placeholder its sample replaces (a serial
    # step's rows append their runs instead, and a prompt chunk samples nothing).
    sample_at: int | None = None
    # The computed tokens to tell the block manager once the row's placeholders are resolved (a
    # prefix hash needs the ids); None when they were told at dispatch.
    computed: int | None = None
    # The sequence's preemption count at dispatch: once preempted, it no longer has those pages.
    preemptions: int = 0


@dataclasses.dataclass(eq=False)
class InFlightStep:
    """A dispatched step: its batch, a record per row (in the batch's order), the runner's pending
    samples and how it must be processed."""

    batch: SchedulerOutput
    rows: list[DispatchedRow]
    pending: Any  # the runner's PendingSamples
    serial: bool  # multi-step or speculative: its runs decide the next step, processed before it is scheduled
    verifies: bool = False  # a speculative step: its acceptance goes to the decoder
    constrained: bool = False  # a row samples under a grammar: the next step's masks need its tokens
    dispatched_at: float = 0.0  # time.perf_counter() when its dispatch returned
    seen_at: float | None = None  # time.perf_counter() when its samples reached the host
    _samples: Any = None

    @property
    def bucket(self) -> int:
        """The token bucket the step ran in: steps of one bucket take about as long."""
        return self.pending.shape[0]

    def samples(self) -> Any:
        """The runner's StepSamples, waiting for the step the first time."""
        if self._samples is None:
            self._samples = self.pending.result()
            self.seen_at = time.perf_counter()
        return self._samples
