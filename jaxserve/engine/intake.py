"""The engine core's input queue: requests and aborts from other threads, taken by the step thread.

Any thread puts; only the step thread takes, between steps (`EngineCore.take_intake`) and, with
async scheduling, while it holds the next step back for arrivals (`EngineCore.execute`), so nothing
else ever touches the scheduler. `wake` is set by every put, by `close`, and once a watched step is
done, so a waiting step thread never polls.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """Stop the request `request_id` (the other message is an `EngineRequest`: add it)."""

    request_id: str


class Intake:
    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()  # EngineRequest (add) | Abort
        self.wake = threading.Event()
        self.closed = threading.Event()
        self._watched: queue.SimpleQueue = queue.SimpleQueue()
        self._watcher: threading.Thread | None = None
        # Another thread feeds this queue (AsyncLLMEngine): only then is a step held back for arrivals.
        # Offline, every request is added before the steps run.
        self.takes_arrivals = False

    def put(self, item: Any) -> None:
        self._items.append(item)
        self.wake.set()

    def take_all(self) -> list[Any]:
        """Everything queued, in order."""
        items = []
        while self._items:
            items.append(self._items.popleft())
        return items

    def take_arrivals(self) -> list[Any]:
        """The requests at the head of the queue, up to the first abort: an abort waits for the next
        `take_all`, since the step being held back may hold the aborted request's row."""
        items = []
        while self._items and not isinstance(self._items[0], Abort):
            items.append(self._items.popleft())
        return items

    def watch(self, pending: Any) -> None:
        """Set `wake` once `pending` (a dispatched step) is done, from a watcher thread: a wake-up
        every millisecond would take CPU from the step's own threads on a small host."""
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
            self.wake.set()

    def close(self) -> None:
        self.closed.set()
        self.wake.set()
        self._watched.put(None)
