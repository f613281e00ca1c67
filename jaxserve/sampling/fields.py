"""One description of the per-request sampling fields, from which the API, validation and device arrays follow.

Each `SamplingField` says once what a field is: its type, `SamplingParams`' default, its valid range,
what it means (the OpenAPI description), whether the HTTP API takes it as it is, its key in a model's
generation_config.json, and whether it becomes a per-row array of `jaxserve.model.sampler.SamplingTensors`
(dtype, and the idle value that padding rows carry). Derived from `FIELDS`:

- `jaxserve.server.protocol`: the pydantic request fields (types, bounds, descriptions; 400 outside them);
- `jaxserve.server.requests`: which request fields are handed to SamplingParams as they are;
- `jaxserve.sampling.params.SamplingParams.__post_init__`: the type and range checks and their messages;
- `jaxserve.config.generation_config`: which keys of generation_config.json are read, and their range checks;
- `jaxserve.model.sampler`: `RowSampling.from_params` and `SamplingTensors.pack` / `.spec` (dtypes, idle values).

The dataclasses themselves (SamplingParams, RowSampling, SamplingTensors) stay written out, because
readers and callers use them as typed constructors with a comment per field; tests/test_sampling_fields.py
fails when one of them disagrees with this table (a field added without an entry, a default or dtype
that differs).

Fields with their own code rather than an entry here, because no range or scalar array describes them:
`stop` and `stop_token_ids` (lists, normalised to tuples), `logit_bias` (a map, checked by
`sampling_params._check_logit_bias`, two [B, 300] arrays on the device), `structured` (a grammar
object, checked against ignore_eos and min_tokens), `kv_transfer_params` (a KV connector's JSON object,
checked by the connector: `kv_transfer.disagg.check_params` on the server). Entries with a little bespoke code next to them:
`max_tokens` and `logprobs` (each endpoint types and defaults them itself: completions' `max_tokens=0`
with echo, chat's `logprobs` flag plus `top_logprobs`), `top_k` (-1 is normalised to 0), `seed` (the
device's per-row seed is the one the engine derives for each sample, not the request's).

No jax or pydantic here: the server, the settings parser and SamplingParams import this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.errors import RequestError

MAX_N = 16  # completions per prompt the HTTP API accepts
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's maximum); the engine compiles for this many


@dataclasses.dataclass(frozen=True)
class DeviceArray:
    """How a field becomes a per-row array of SamplingTensors (f32[B] or i32[B])."""

    dtype: str  # a NumPy dtype name
    idle: float | int  # what padding rows carry: neutral (greedy, no limit, penalty off)


@dataclasses.dataclass(frozen=True)
class SamplingField:
    """One field of SamplingParams: what it is, what it accepts, and where else it appears."""

    name: str
    type: type  # int, float or bool
    default: Any  # SamplingParams' default; None: the field is optional
    description: str  # what it does, as the OpenAPI schema documents it
    ge: float | None = None  # bounds, checked by SamplingParams and stated by the API schema
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    api_le: float | None = None  # a stricter upper bound only the HTTP API states (OpenAI's limits)
    must: str | None = None  # the error's "must be ..." text, where the bounds alone do not say it
    request: bool = True  # the HTTP API takes it under this name and hands it to SamplingParams as is
    config_key: str | None = None  # its key in generation_config.json (a model's default for it)
    device: DeviceArray | None = None  # a per-row array of SamplingTensors of the same name

    def valid(self, value: Any) -> bool:
        """Whether SamplingParams takes `value`. Ints must be ints (not bools); floats are only compared,
        so NaN fails every bound and a non-number raises TypeError (a 400 in the server); bools are
        taken as given."""
        if value is None and self.default is None:
            return True
        if self.type is bool:
            return True
        if self.type is int and (isinstance(value, bool) or not isinstance(value, int)):
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def requirement(self) -> str:
        """E.g. "in (0, 1]" or "an integer >= 1": what the error says the value must be."""
        if self.must is not None:
            return self.must
        lower = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        upper = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else None
        if lower and upper:
            text = f"in {lower}, {upper}"
        elif lower:
            text = f">= {self.ge:g}" if self.ge is not None else f"> {self.gt:g}"
        else:
            text = f"<= {self.le:g}" if self.le is not None else f"< {self.lt:g}"
        return f"an integer {text}" if self.type is int else text

    def check(self, value: Any) -> None:
        if not self.valid(value):
            raise RequestError(f"{self.name} must be {self.requirement()}, got {value!r}")

    def api_description(self) -> str:
        """The description plus where the default comes from, for the OpenAPI schema."""
        if self.config_key is not None:
            return f"{self.description}; default: the model's generation_config.json, else {_shown(self.default)}"
        if self.default is None:
            return self.description
        return f"{self.description}; default {_shown(self.default)}"


def _shown(value: Any) -> str:
    """A default as JSON writes it: true, 1, 0.5."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


F32 = "float32"
I32 = "int32"

FIELDS: tuple[SamplingField, ...] = (
    SamplingField(
        "max_tokens", int, 16, "the most tokens to generate", ge=1, request=False, config_key="max_new_tokens"
    ),
    SamplingField(
        "temperature", float, 1.0, "0 is greedy", ge=0, api_le=2, config_key="temperature", device=DeviceArray(F32, 0.0)
    ),
    SamplingField(
        "top_k",
        int,
        0,
        "0 or -1: no limit",
        ge=-1,
        must="0 or -1 (no limit) or a positive integer",
        config_key="top_k",
        device=DeviceArray(I32, 0),
    ),
    SamplingField(
        "top_p",
        float,
        1.0,
        "sample from the most likely tokens that make up this much probability; 1: no limit",
        gt=0,
        le=1,
        config_key="top_p",
        device=DeviceArray(F32, 1.0),
    ),
    SamplingField(
        "seed",
        int,
        None,
        "the same seed, prompt and parameters give the same output; default: random",
        ge=0,
        lt=2**32,
        must="in [0, 2**32)",
    ),
    SamplingField("ignore_eos", bool, False, "keep generating past the end-of-sequence token"),
    SamplingField("n", int, 1, "completions per prompt", ge=1, api_le=MAX_N),
    SamplingField("min_tokens", int, 0, "EOS and stop conditions are ignored before this many tokens", ge=0),
    SamplingField("include_stop_str_in_output", bool, False, "keep the matched stop string in the returned text"),
    SamplingField("skip_special_tokens", bool, True, "leave special tokens out of the returned text"),
    SamplingField(
        "min_p",
        float,
        0.0,
        "drop tokens less likely than min_p times the most likely one; 0: no limit",
        ge=0,
        le=1,
        config_key="min_p",
        device=DeviceArray(F32, 0.0),
    ),
    SamplingField(
        "repetition_penalty",
        float,
        1.0,
        "penalises tokens of the prompt and the output so far "
        "(HF/vLLM: a positive logit divided by it, a negative one multiplied); 1: off",
        gt=0,
        api_le=100,
        config_key="repetition_penalty",
        device=DeviceArray(F32, 1.0),
    ),
    SamplingField(
        "presence_penalty",
        float,
        0.0,
        "subtracted from the logit of each token the output already has (OpenAI); 0: off",
        ge=-2,
        le=2,
        device=DeviceArray(F32, 0.0),
    ),
    SamplingField(
        "frequency_penalty",
        float,
        0.0,
        "subtracted from a token's logit once per time the output has it (OpenAI); 0: off",
        ge=-2,
        le=2,
        device=DeviceArray(F32, 0.0),
    ),
    SamplingField(
        "logprobs",
        int,
        None,
        "top-N logprobs per output token (0: only the chosen token's)",
        ge=0,
        le=MAX_LOGPROBS,
        request=False,
    ),
    SamplingField(
        "prompt_logprobs",
        int,
        None,
        "top-N logprobs per prompt token (0: only the prompt token's)",
        ge=0,
        le=MAX_LOGPROBS,
    ),
)

BY_NAME: dict[str, SamplingField] = {f.name: f for f in FIELDS}
# The fields of FIELDS that are per-row arrays of SamplingTensors, in table order.
DEVICE_FIELDS: tuple[SamplingField, ...] = tuple(f for f in FIELDS if f.device is not None)
# SamplingParams fields with their own code (see the module docstring).
BESPOKE = ("stop_token_ids", "stop", "logit_bias", "structured", "kv_transfer_params")
