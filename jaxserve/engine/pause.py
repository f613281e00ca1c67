"""Pause and sleep, as vLLM means them: the host's half (no jax), shared by LLM, LLMEngine and
AsyncLLMEngine.

`pause(mode)` stops generation so a trainer can swap the weights between two steps:

- "abort": every request in the engine ends now (finish_reason "abort", what it generated so far);
- "wait": requests already in the engine run to completion first; new ones wait;
- "keep": requests stay where they are, their KV cache kept, and continue after `resume()` (with the
  weights of then: the tokens before the pause came from the old weights, as vLLM's partial rollouts).

`sleep(level)` also frees the devices for the trainer: level 1 moves the weights to host memory and
discards the KV cache, level 2 discards both (new weights come with `update_weights`). A sleeping
engine aborts what it held and refuses requests (`EngineSleepingError`: the server's 503) until
`wake_up()` has brought back the weights and the KV cache (`wake_up(["weights"])` or
`wake_up(["kv_cache"])` one of them: a trainer can load weights before the pool comes back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from jaxserve.errors import EnginePausedError, EngineSleepingError, RequestError

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_LEVELS = (1, 2)
SLEEP_TAGS = ("weights", "kv_cache")


def check_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise RequestError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
    return mode


def check_level(level: Any) -> int:
    if level not in SLEEP_LEVELS or isinstance(level, bool):
        raise RequestError(f"sleep level must be 1 (weights to host memory) or 2 (weights discarded); got {level!r}")
    return int(level)


def check_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """The parts `wake_up(tags)` restores: all of them for None."""
    if tags is None:
        return SLEEP_TAGS
    tags = tuple(tags)
    unknown = [t for t in tags if t not in SLEEP_TAGS]
    if unknown or not tags:
        raise RequestError(f"wake_up tags must be among {', '.join(SLEEP_TAGS)}; got {list(tags)!r}")
    return tags


@dataclasses.dataclass
class PauseState:
    """Whether the engine generates: paused (by `pause`), and which parts sleep took off the devices."""

    paused: bool = False
    mode: str | None = None  # the pause's mode
    level: int = 0  # the sleep's level; 0 awake
    asleep: set[str] = dataclasses.field(default_factory=set)  # among SLEEP_TAGS: what is off the devices

    @property
    def sleeping(self) -> bool:
        """Asleep until every part is back (vLLM's is_sleeping)."""
        return bool(self.asleep)

    @property
    def holds(self) -> bool:
        """No step may run: paused or (partly) asleep."""
        return self.paused or self.sleeping

    def pause(self, mode: str) -> None:
        self.paused, self.mode = True, check_mode(mode)

    def resume(self) -> None:
        self.paused, self.mode = False, None

    def fell_asleep(self, level: int) -> None:
        self.level, self.asleep = check_level(level), set(SLEEP_TAGS)

    def woke(self, tags: Iterable[str]) -> None:
        self.asleep -= set(tags)
        if not self.asleep:
            self.level = 0

    def check_serving(self) -> None:
        """Refuse a new request while asleep (EngineSleepingError) or paused (EnginePausedError)."""
        if self.sleeping:
            raise EngineSleepingError(
                f"the engine is asleep (sleep level {self.level}; {' and '.join(sorted(self.asleep))} off the "
                "devices): call wake_up() (POST /wake_up) first"
            )
        if self.paused:
            raise EnginePausedError(f"generation is paused (mode {self.mode!r}): call resume() (POST /resume) first")


def abort_all(core: Any) -> list:
    """Abort every request the core holds; their last deltas (finish_reason "abort")."""
    outputs = [core.abort_request(request_id) for request_id in list(core.requests)]
    return [out for out in outputs if out is not None]
