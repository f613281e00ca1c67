"""Sleep mode on the mock engine (`MockAsyncLLMEngine`): the methods the trainer's routes call
(server/sleep_routes.py), with the real engine's answers and refusals, so a server started with
`--mock-engine --enable-sleep-mode` answers them without a model. Nothing is freed (there is nothing
to free); a sleeping mock refuses requests (EngineSleepingError, the server's 503) and sleeping
aborts what it runs, as the real engine does; a paused one still generates."""

from __future__ import annotations

import os
from typing import Any

from jaxserve.engine.pause import PauseState, check_level, check_mode, check_tags
from jaxserve.errors import RequestError


class MockSleepMode:
    """Mixed into MockAsyncLLMEngine."""

    pause_state: PauseState
    weight_version: Any = 0

    def _sleep_state(self) -> PauseState:
        if "pause_state" not in self.__dict__:
            self.pause_state = PauseState()
        return self.pause_state

    def check_awake(self) -> None:
        if self._sleep_state().sleeping:
            self.pause_state.check_serving()

    async def sleep(self, level: int = 1) -> None:
        level = check_level(level)
        for request_id in list(self._by_id):
            self.abort(request_id)
        self._sleep_state().fell_asleep(level)

    async def wake_up(self, tags: Any = None) -> None:
        self._sleep_state().woke(check_tags(tags))

    async def is_sleeping(self) -> bool:
        return self._sleep_state().sleeping

    async def pause(self, mode: str = "abort") -> None:
        if check_mode(mode) == "abort":
            for request_id in list(self._by_id):
                self.abort(request_id)
        self._sleep_state().pause(mode)

    async def resume(self) -> None:
        self._sleep_state().resume()

    async def is_paused(self) -> bool:
        return self._sleep_state().paused

    async def update_weights_from_disk(
        self, model_path: str, load_format: Any = None, weight_version: Any = None, *, abort_all_requests: bool = False
    ) -> tuple[Any, int]:
        if not os.path.isdir(os.path.expanduser(model_path)):
            raise RequestError(f"model_path {model_path!r} is not a checkpoint directory on the server")
        aborted = list(self._by_id) if abort_all_requests else []
        for request_id in aborted:
            self.abort(request_id)
        self.weight_version = weight_version if weight_version is not None else (self.weight_version or 0) + 1
        state = self._sleep_state()
        if state.sleeping:
            state.woke(["weights"])
        return _Report(self.weight_version), len(aborted)


class _Report:
    """What the routes read of an UpdateReport."""

    tensors, seconds = 0, 0.0

    def __init__(self, weight_version: Any):
        self.weight_version = weight_version
