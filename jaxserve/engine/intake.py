"""The engine core's input queue: requests and aborts from other threads, taken by the step thread.

Any thread puts; only the step thread takes, between steps (`EngineCore.take_intake`) and, with
async scheduling, while it holds the next step back for arrivals (`EngineCore.admit_arrivals`, from
`engine.overlap`), so nothing else ever touches the scheduler. `wake` is set by every put, by
`close`, and by the overlap wrapper's watcher once the step in flight is done, so a waiting step
thread never polls.
"""

from __future__ import annotations

import collections
import dataclasses
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

    def close(self) -> None:
        self.closed.set()
        self.wake.set()
