"""Host-side state of one generated sequence (no jax): its tokens, how many have KV in the cache, its fate."""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import time
from typing import Any

from jaxserve.model.ragged import is_placeholder
from jaxserve.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # no pages; queued for admission (new, or preempted)
    RUNNING = "running"  # holds pages; computes a prompt chunk or one decode token per step
    # holds pages while a KV connector loads some of them (jaxserve.kv_transfer): neither running nor waiting
    WAITING_FOR_KV = "waiting_for_kv"
    FINISHED = "finished"


def token_slice(prompt: list[int], output: list[int], start: int, stop: int) -> list[int]:
    """(prompt + output)[start:stop] for 0 <= start <= stop <= the total, without joining the lists
    (a decode row's one token is a slice of `output` alone)."""
    p = len(prompt)
    if stop <= p:
        return prompt[start:stop]
    if start >= p:
        return output[start - p : stop - p]
    return prompt[start:] + output[: stop - p]


class TokenView(collections.abc.Sequence):
    """prompt + output read in place: a step slices a row's few tokens (and the block manager a
    page's) without the whole list being rebuilt each step."""

    def __init__(self, prompt: list[int], output: list[int]):
        self._prompt, self._output = prompt, output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    def __getitem__(self, index):
        p = len(self._prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return list(self)[index]
            return token_slice(self._prompt, self._output, start, stop)
        if index < 0:
            index += len(self)
        return self._prompt[index] if index < p else self._output[index - p]


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample of a request (a request with n > 1 has n sequences sharing the prompt's pages).

    The sequence's work is always `tokens[num_computed:]`: a prompt chunk while prefilling (or
    recomputing after preemption), a single token while decoding. The step that computes its last
    pending token samples the next one.
    """

    seq_id: str
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # this sample's random stream: tokens depend on (seed, output index) only
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    status: Status = Status.WAITING
    replica: int | None = None
    finish_reason: str | None = None
    num_siblings_to_fork: int = 0  # n - 1 for a request's first sequence, until it forks
    detokenizer: Any = None  # IncrementalDetokenizer, when the engine has a tokenizer
    text: str = ""
    stop_text_len: int | None = None  # where a stop string cut the text
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)  # when params.logprobs is set
    # When params.prompt_logprobs is set (first sample only; siblings share the prompt): one entry per
    # prompt token, filled as prefill chunks are computed.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    spec: Any = None  # spec_decode.SpecState when speculative decoding is on: draft lag, acceptance
    # Structured output: the GrammarMatcher (jaxserve.structured) holding the grammar's state after the
    # output so far. Preemption by recompute keeps it (the output is kept); n > 1 siblings get copies.
    grammar: Any = None
    lora: Any = None  # its LoRA adapter (engine.lora_manager.Adapter); None: the base model
    kv_load_tokens: int = 0  # tokens a KV connector is loading into its pages (Status.WAITING_FOR_KV)
    kv_transfer_params_out: dict | None = None  # what its connector's request_finished returned
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # What the caller has been sent (the output processor emits only what is new: its deltas)
    ids_emitted: int = 0  # output tokens (and their logprob entries)
    text_emitted: int = 0  # characters of `text`
    finish_emitted: bool = False

    @property
    def prefix_root(self) -> bytes:
        """Where its prefix-cache key chain starts: its adapter's own root, or the base model's."""
        return b"" if self.lora is None else self.lora.prefix_root

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def token_view(self) -> TokenView:
        """The tokens (prompt + output) without a copy."""
        return TokenView(self.prompt_token_ids, self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_flight(self) -> bool:
        """Its last token is a placeholder (jaxserve.model.ragged.placeholder): sampled by the step in
        flight, its id not yet on the host."""
        return bool(self.output_token_ids) and is_placeholder(self.output_token_ids[-1])

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def compute_target(self) -> int:
        """How far computing may go this round: a parent about to fork stops before the last prompt
        token, so each sibling samples its own first token from it."""
        return self.num_tokens - 1 if self.num_siblings_to_fork else self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
