"""How long async scheduling may hold the next step back for requests still arriving (no jax).

With async scheduling, step N+1 is scheduled while step N runs. If it is dispatched at once, a
request that arrives during step N has to wait for step N+2: one step more time to first token than a
serial engine gives (docs/BENCHMARKS.md, "Where the TTFT goes: async scheduling"). Instead the overlap
wrapper (`engine/overlap.py`) holds N+1 back after scheduling it until just before step N is expected
to end, and a request that arrives meanwhile still gets its first prompt chunk into N+1 before it is
packed. The device never waits: N+1 is packed and queued behind N before N ends.

The expected end comes from recent steps: when the previous step's samples were seen (N starts then,
or at its dispatch if later), plus the shortest recent device time of N's token bucket (a step that
ends sooner than its estimate leaves the device idle until the next one is dispatched, so the
estimate errs short). The window closes early enough for N+1's packing and dispatch to land first (a
few times their median time). If N ends sooner still, the engine is woken and dispatches then. Until a
bucket has run `MIN_SAMPLES` times, the window stays shut and the next step is dispatched at once.
"""

from __future__ import annotations

import collections
import statistics

HISTORY = 8  # recent steps per bucket whose times make the estimate
MIN_SAMPLES = 3
MIN_MARGIN_S = 0.0005  # the window closes at least this long before the expected end
DISPATCH_MARGIN = 3  # ... and at least this many median dispatch times before it


class ArrivalWindow:
    """Step times seen by the overlap wrapper: `dispatched` and `done` for each step, `closes_at` for
    the step in flight. Times are `time.perf_counter()` seconds."""

    def __init__(self) -> None:
        self._durations: dict[int, collections.deque[float]] = {}
        self._dispatch_seconds: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self._last_done: float | None = None

    def dispatched(self, seconds: float) -> None:
        """A step's `EngineCore.execute` took `seconds`: packing its inputs, their copy and the call."""
        self._dispatch_seconds.append(seconds)

    def done(self, bucket: int, dispatched_at: float, seen_at: float) -> None:
        """A step of `bucket` tokens, dispatched at `dispatched_at`, had its samples seen at `seen_at`.
        The device ran it from the later of its dispatch and the previous step's end."""
        durations = self._durations.setdefault(bucket, collections.deque(maxlen=HISTORY))
        durations.append(seen_at - self._start(dispatched_at))
        self._last_done = seen_at

    def closes_at(self, bucket: int, dispatched_at: float) -> float | None:
        """When to stop holding the next step back, the step in flight being of `bucket` tokens and
        dispatched at `dispatched_at`; None when its end cannot be estimated yet."""
        durations = self._durations.get(bucket)
        if durations is None or len(durations) < MIN_SAMPLES or not self._dispatch_seconds:
            return None
        margin = max(MIN_MARGIN_S, DISPATCH_MARGIN * statistics.median(self._dispatch_seconds))
        return self._start(dispatched_at) + min(durations) - margin

    def _start(self, dispatched_at: float) -> float:
        """When the device began a step dispatched at `dispatched_at`: then, or when the one before ended."""
        return dispatched_at if self._last_done is None else max(dispatched_at, self._last_done)
