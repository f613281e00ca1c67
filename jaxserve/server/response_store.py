"""The bounded in-memory store of `POST /v1/responses` (`store: true`, OpenAI's default).

A stored response is what `GET /v1/responses/{id}` returns and what `previous_response_id` continues:
the response object, and the conversation it ended (its input as chat messages, then its output as
an assistant message), so a follow-up is rendered from messages rather than re-read from items.

Bounded two ways, both settings (`responses_store_max_entries`, `responses_store_max_age`): past the
count the oldest response is evicted, and a response older than the age is dropped when the store is
next touched. Nothing survives a restart and nothing is shared between replicas: a client that must
continue a conversation across them sends the whole input instead. The store lives on the event loop
(every call is synchronous, no awaits inside), so it needs no lock.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_AGE_S = 3600.0


@dataclasses.dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as POST returned it (or its stream's last event)
    messages: list[dict[str, Any]]  # the conversation up to and including its output (chat-message dicts)
    stored_at: float


class ResponseStore:
    """Response id -> `StoredResponse`, at most `max_entries`, none older than `max_age_s` seconds."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_entries < 1 or max_age_s <= 0:
            raise ValueError(
                f"a response store needs max_entries >= 1 and max_age_s > 0, got {max_entries}, {max_age_s}"
            )
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.clock = clock
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()  # oldest first
        self.evicted = 0  # responses dropped for the count or the age (not deleted by a client)

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def _expire(self) -> None:
        cutoff = self.clock() - self.max_age_s
        while self._items:
            oldest = next(iter(self._items.values()))
            if oldest.stored_at > cutoff:
                break
            self._items.popitem(last=False)
            self.evicted += 1

    def put(self, response_id: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._expire()
        self._items.pop(response_id, None)
        self._items[response_id] = StoredResponse(response, messages, self.clock())
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)
            self.evicted += 1

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._items.pop(response_id, None) is not None
