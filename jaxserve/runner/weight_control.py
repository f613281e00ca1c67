"""The engine's methods for a training loop: new weights without a restart, pause and resume, sleep
and wake up (LLMEngine's; `LLM` and `AsyncLLMEngine` call them, the latter between two steps).

A mixin over `EngineCore` so the core stays host only: the weights are `weight_update.WeightUpdater`'s,
the device buffers' sleep `sleep_mode.DeviceSleep`'s, the requests' side `engine.pause`. It adds one
check before every step (the runner's `before_step`): a weight adopted from the caller that a trainer
step has since donated raises `WeightsDeletedError` there, not an XLA error inside the step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from jaxserve.engine.pause import PauseState, abort_all, check_level, check_mode, check_tags
from jaxserve.runner.sleep_mode import DeviceSleep
from jaxserve.runner.weight_update import UpdateReport, WeightUpdater
from jaxserve.sampling.params import RequestOutput

logger = logging.getLogger(__name__)


class WeightControl:
    """Mixed into LLMEngine (before EngineCore); `_init_weight_control()` once the runner is built."""

    def _init_weight_control(self) -> None:
        runner = self.runner
        state = runner.state
        self.pause_state = PauseState()
        self.weights = WeightUpdater(lambda: state.params, lambda p: setattr(state, "params", p), self.model_config)
        self.draft_weights = None
        spec = runner.speculation
        if spec is not None and spec.method == "draft":  # an EAGLE-3 head is served as loaded
            self.draft_weights = WeightUpdater(
                lambda: state.draft_params, lambda p: setattr(state, "draft_params", p), spec.draft_cfg, "draft model"
            )
        self.device_sleep = DeviceSleep(state, [u for u in (self.weights, self.draft_weights) if u is not None])
        self.weight_updates = 0  # update_weights calls (the counted weight_version)
        runner.before_step.append(self.check_weights)

    @property
    def weight_version(self) -> int | str:
        """The version every output carries: the last update's weight_version, or the count of updates."""
        return self.outputs.weight_version

    # ---- new weights ------------------------------------------------------------------------------
    def update_weights(
        self,
        params: Any = None,
        weight_version: int | str | None = None,
        *,
        draft_params: Any = None,
        copy: bool = False,
    ) -> UpdateReport:
        """Serve new weights from the next step on, compiling nothing: `params` a Params pytree in the
        engine's layout, a mapping of Hugging Face tensor names to arrays, or an iterable of (name,
        array) chunks (`weight_update.WeightUpdater.update`). Arrays already on the engine's devices
        and sharding are served as they are (`copy=True`: copies); others are placed, cast and, on an
        int8 / int4 engine, quantized one tensor at a time. A draft model's weights are updated from
        `draft_params`, else kept (the report says which). The prefix cache is emptied; requests
        running go on with the new weights over the KV they have. `weight_version`: what every output
        carries from now on (default: the count of updates)."""
        self._check_open()
        speculator = self.runner.speculation
        if draft_params is not None and self.draft_weights is None:
            if speculator is not None and speculator.method == "eagle3":
                raise ValueError(
                    "draft_params: an EAGLE-3 head is served as loaded (it is not updated; restart with a new head)"
                )
            raise ValueError("draft_params given, but this engine has no draft model")
        self.weight_updates += 1
        version = weight_version if weight_version is not None else self.weight_updates
        report = UpdateReport(weight_version=version)
        if speculator is not None and speculator.method == "eagle3":
            report.draft = "kept"  # the head drafts from the new target's own states from the next step on
        try:
            if params is not None:
                self.weights.update(params, copy, report)
            if self.draft_weights is not None:
                report.draft = "kept" if draft_params is None else "updated"
                if draft_params is not None:
                    self.draft_weights.update(draft_params, copy, report)
        finally:  # even a failed update may have replaced some tensors: no KV of the old ones is reused
            self.blocks.reset_prefix_cache()
        self.outputs.weight_version = version
        if self.pause_state.sleeping and self.device_sleep.weights_on_device:
            self.pause_state.woke(["weights"])
        logger.info(
            "weights %s: %d tensors (%d adopted, %d copied, %d quantized) in %.1f ms; draft model: %s",
            version,
            report.tensors,
            report.adopted,
            report.copied,
            report.quantized,
            report.seconds * 1e3,
            report.draft,
        )
        return report

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: int | str | None = None
    ) -> UpdateReport:
        """SGLang's: new weights from a checkpoint directory of this model's shape (safetensors, or a
        GGUF-backed one), read tensor by tensor from memory maps (`update_weights` of the chunks)."""
        import os

        from jaxserve.errors import RequestError
        from jaxserve.loading.checkpoint import iter_checkpoint_tensors

        if load_format not in (None, "auto", "safetensors"):
            raise RequestError(f"load_format {load_format!r}: only auto / safetensors checkpoints are read")
        path = os.path.expanduser(model_path)
        if not os.path.isdir(path):
            raise RequestError(f"model_path {model_path!r} is not a checkpoint directory on the server")
        chunks = ((name, tensor) for _, name, tensor in iter_checkpoint_tensors(path))
        return self.update_weights(chunks, weight_version)

    def check_weights(self) -> None:
        """WeightsDeletedError if an adopted weight was deleted since (checked before every step)."""
        self.weights.check()
        if self.draft_weights is not None:
            self.draft_weights.check()

    def check_serving(self) -> None:
        """Refuse new requests while asleep or paused, or with deleted weights."""
        self._check_open()
        self.pause_state.check_serving()
        self.check_weights()

    # ---- pause ------------------------------------------------------------------------------------
    def pause(self, mode: str = "abort") -> list[RequestOutput]:
        """Stop generating (`engine.pause`): "abort" ends every request now, "wait" runs them to the end
        first, "keep" leaves them for `resume()`. Returns the deltas this produced."""
        check_mode(mode)
        outputs: list[RequestOutput] = []
        if mode == "abort":
            outputs = abort_all(self)
        elif mode == "wait":
            while self.has_unfinished_requests():
                outputs += super().step()
        self.pause_state.pause(mode)
        return outputs

    def resume(self) -> None:
        self.pause_state.resume()

    def is_paused(self) -> bool:
        return self.pause_state.paused

    # ---- sleep ------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> list[RequestOutput]:
        """Free the devices (`engine.pause`): level 1 keeps the weights in host memory, level 2 discards
        them; the KV cache is discarded in both, so every request still held is aborted (their last
        deltas are returned) and the prefix cache emptied. Requests are refused until `wake_up()`."""
        level = check_level(level)
        self._check_open()
        outputs = abort_all(self)
        self.blocks.reset_prefix_cache()
        self.device_sleep.sleep(level)
        self.pause_state.fell_asleep(level)
        logger.info("asleep at level %d", level)
        return outputs

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Bring back the weights and the KV cache, or only `tags` ("weights", "kv_cache"); level 2's
        weights come back only with update_weights (EngineSleepingError here until then)."""
        tags = check_tags(tags)
        self._check_open()
        self.device_sleep.wake_up(tags)
        self.pause_state.woke(tags)

    def is_sleeping(self) -> bool:
        return self.pause_state.sleeping

    # ---- the core's entry points, checked ----------------------------------------------------------
    def admit(self, *args: Any, **kwargs: Any) -> None:
        self.pause_state.check_serving()
        super().admit(*args, **kwargs)

    def step(self) -> list[RequestOutput]:
        if self.pause_state.holds:  # paused or asleep: requests kept stay where they are
            return self.take_outbox()
        return super().step()
