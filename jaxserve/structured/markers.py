"""The tail of a text being written that may still become a marker (plain Python, no jax).

Whoever reads text as it is generated and cuts it at a marker (the engine at a stop string, the
server's parsers at `<tool_call>` or `</think>`, `ReasoningGatedMatcher` at the end-of-reasoning
bytes) must withhold a tail that could be the marker's start until the next piece decides it, so
nothing is released and then taken back. It lives in `structured/`, the lowest host package that
all three import (`sampling.params` imports `structured.spec`, so the engine cannot be imported
from here).
"""

from __future__ import annotations

from typing import Sequence, TypeVar

__all__ = ["held_back"]

T = TypeVar("T", str, bytes)


def held_back(text: T, markers: Sequence[T]) -> int:
    """How many characters (bytes, for bytes) at the end of `text` to withhold: the longest tail that
    is a proper prefix of one of `markers` (a whole marker is the caller's to find)."""
    hold = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), hold, -1):
            if text.endswith(marker[:n]):
                hold = n
                break
    return hold
