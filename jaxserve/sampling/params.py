"""SamplingParams (what a request asks for) and the outputs returned to users, in vLLM's shape."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxserve.errors import RequestError
from jaxserve.sampling.fields import FIELDS
from jaxserve.structured.spec import StructuredSpec


@dataclasses.dataclass
class SamplingParams:
    """How to generate. temperature 0 is greedy; top_k 0 (or -1) and top_p 1 mean no limit.

    The type, range and meaning of each field are in `jaxserve.sampling.fields.FIELDS`, which
    __post_init__ checks against; stop, stop_token_ids, logit_bias and structured have their own checks.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    n: int = 1
    stop: Sequence[str] = ()  # strings; the returned text is cut before the first match
    min_tokens: int = 0  # EOS and stop conditions are ignored before this many tokens
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens (HF/vLLM semantics)
    presence_penalty: float = 0.0  # over output tokens (OpenAI semantics)
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top-N logprobs per output token (0: only the chosen token's)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (0: only the prompt token's)
    # token id -> added to its logit before every sampling step (greedy too), in [-100, 100] (OpenAI);
    # at most 300 entries. The engine refuses ids outside the model's vocabulary.
    logit_bias: dict[int, float] | None = None
    # Structured output: the output is constrained to this JSON schema, regex, choice or grammar
    # (build one with StructuredSpec's classmethods or jaxserve.structured.spec_from_request). A
    # finished grammar ends the output; one cut by max_tokens is finish_reason "length".
    structured: StructuredSpec | None = None
    # vLLM's: what a KV connector (jaxserve.kv_transfer) needs of this request, as a proxy sends it
    # (prefill and decode apart); passed to the engine's connector untouched.
    kv_transfer_params: dict | None = None

    def __post_init__(self):
        for field in FIELDS:  # types and ranges; a RequestError whose message starts with the field's name
            field.check(getattr(self, field.name))
        if self.top_k == -1:
            self.top_k = 0
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop must be a list of non-empty strings")
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise RequestError("kv_transfer_params must be a JSON object")
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredSpec):
                raise RequestError(
                    f"structured must be a jaxserve.structured.StructuredSpec, got {type(self.structured).__name__}"
                )
            # A finished grammar allows only EOS: an output that may not end there cannot be served.
            if self.ignore_eos:
                raise RequestError(
                    "ignore_eos cannot be combined with structured output (a finished grammar ends the output with EOS)"
                )
            if self.min_tokens:
                raise RequestError(
                    "min_tokens cannot be combined with structured output (the grammar decides where the output ends)"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit; jaxserve.model.sampler carries this many per row)


def _check_logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias} with int ids (decimal strings accepted, as JSON keys are) and biases in [-100, 100]."""
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must be a map of token id -> bias, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            if isinstance(key, bool) or not isinstance(key, (int, str)):
                raise ValueError
            token = int(key)
        except ValueError:
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}") from None
        if token < 0:
            raise RequestError(f"logit_bias token id {token} is negative")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias[{token}] must be a number in [-100, 100], got {value!r}")
        out[token] = float(value)
    return out or None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    # Per output token, {token id: logprob} for the chosen token and the top-N (when logprobs was asked).
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    def sampled_logprobs(self) -> np.ndarray | None:
        """f32[len(token_ids)]: each sampled token's logprob as one array (what a trainer's loss takes;
        `logprobs=0` asks for them alone), or None when logprobs were not asked for."""
        if self.logprobs is None:
            return None
        return np.asarray([entry[t] for entry, t in zip(self.logprobs, self.token_ids)], np.float32)


@dataclasses.dataclass
class RequestMetrics:
    """Times on the time.monotonic() clock."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding (None when it is off): draft tokens proposed, how many of them the target
    # accepted, and the verify steps that had at least one draft (summed over the request's samples).
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    spec_verify_steps: int | None = None

    @property
    def spec_acceptance_rate(self) -> float | None:
        if self.spec_draft_tokens is None:
            return None
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens per verify step: accepted drafts plus the target's own token."""
        if self.spec_verify_steps is None:
            return None
        steps = self.spec_verify_steps
        return (self.spec_accepted_tokens + steps) / steps if steps else 0.0


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # With prompt_logprobs: per prompt token, {token id: logprob} of it and the top-N given the tokens
    # before it; None for the first token (nothing predicts it). Complete once the prompt is computed.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # The weights that produced it: `update_weights(..., weight_version=)`'s, else the count of updates
    # (0: the weights the engine started with), as SGLang's weight_version.
    weight_version: int | str | None = None
    # vLLM's: what the engine's KV connector returned when the request finished (a prefill engine's
    # say where its pages wait for a decode engine: docs/disaggregation.md); on the final output only.
    kv_transfer_params: dict | None = None
