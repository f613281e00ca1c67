"""One row's sampling as the host describes it to the device sampler (`jaxserve.model.sampler`
turns rows into `SamplingTensors`). Plain Python, so the host-only engine builds it."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from jaxserve.sampling.fields import DEVICE_FIELDS


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Parameters of one row; defaults are neutral, so a padding row is greedy and unpenalised.

    The fields down to frequency_penalty are the table's device fields (`sampling_fields.DEVICE_FIELDS`),
    each defaulting to its idle value (tests/test_sampling_fields.py holds them to it)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 (or -1) = no limit
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens
    presence_penalty: float = 0.0  # over output tokens only
    frequency_penalty: float = 0.0  # over output tokens only
    seed: int = 0
    step: int = 0  # index of the token being sampled within its request's output
    prompt_ids: Sequence[int] = ()  # only read when a penalty is set
    output_ids: Sequence[int] = ()  # tokens generated before this step; only read when a penalty is set
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit (at most MAX_LOGIT_BIAS)
    logprobs: int = 0  # top logprobs the row returns (0: its token's only); a step computes them if a row asks

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_params(
        cls, params: Any, *, seed: int, step: int, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = ()
    ) -> RowSampling:
        """From a SamplingParams: its device fields, logit_bias and logprobs, with the engine's seed and step."""
        return cls(
            **{f.name: getattr(params, f.name) for f in DEVICE_FIELDS},
            seed=seed,
            step=step,
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            logit_bias=params.logit_bias,
            logprobs=params.logprobs or 0,
        )
