"""What goes into one executed step and what comes out of it, host side.

`StepRow` (`jaxserve.runner.step_row`) is one sequence's share of a step, as the running batch
(`runner/running_batch.py`) reads it from its slots; `StepInputs` is the rows laid out in a bucket
(the inputs the compiled step reads); `PendingSamples` is a dispatched step on its way back; `StepSamples` is what it produced, one run of tokens per row. Plain steps,
multi-step calls and speculative steps all end in a `StepSamples`, so the engine updates its
sequences from every kind of step with one loop (`EngineCore.update_from_output`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import numpy as np

from jaxserve.model.kv_cache import RaggedBatch
from jaxserve.model.sampler import SampleOutput, SamplingTensors
from jaxserve.model.transfer import SPARSE_FIELDS
from jaxserve.structured.apply import TokenMask


@flax.struct.dataclass
class PromptScores:
    """Per chunk token t: the logprob of the token after it (`targets[t]`) and the top-N alternatives."""

    target_logprobs: jax.Array  # f32[..., T]
    top_ids: jax.Array  # i32[..., T, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[..., T, MAX_LOGPROBS]


@dataclasses.dataclass
class StepSamples:
    """A step's samples in row order: row i emitted `tokens[i, :num_emitted[i]]` (one token for a
    plain step's sampling row, none for a prompt chunk that does not end its prompt, up to the
    decode steps of a multi-step call, the accepted drafts plus one of a verification). Logprobs
    are None when no row asked for them (they stayed on the device)."""

    tokens: np.ndarray  # i32[n, W]
    num_emitted: np.ndarray  # i32[n]
    logprobs: np.ndarray | None = None  # f32[n, W]
    top_ids: np.ndarray | None = None  # i32[n, W, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None = None  # f32[n, W, MAX_LOGPROBS]
    scores: PromptScores | None = None  # prompt logprobs: [n, tokens of the longest row, ...]

    def row(self, i: int) -> SampleOutput:
        """Row i's run as a SampleOutput of [W] (what `OutputProcessor.record_logprobs` reads)."""
        pick = lambda x: None if x is None else x[i]
        return SampleOutput(self.tokens[i], pick(self.logprobs), pick(self.top_ids), pick(self.top_logprobs))


@dataclasses.dataclass
class StepInputs:
    """Rows laid out in one ragged step, and where each row's sample and tokens landed."""

    shape: tuple  # the executable's key: (tokens, pages) and the variant's tag
    batch: RaggedBatch  # numpy, leading R
    sampling: SamplingTensors  # [R, L]
    mask: TokenMask | None  # numpy [R, L]: the constrained rows' grammar masks (None: the variant takes none)
    logit_at: np.ndarray  # each row's flat index in [R * L] (its sample); -1 for rows that do not sample
    token_at: list[tuple[int, int, int]]  # each row's (replica, first token, tokens)
    extra: tuple = ()  # the variant's further inputs: scoring's (sample index, targets), multi-step's
    #                    steps per row, speculation's (SpecRows, DraftInputs | None)
    # A plain step written by its bucket's InputBatch: the packed buffer (what Layout.pack makes of
    # batch, sampling and mask), which batch, sampling and mask are views of until the bucket's next step.
    buffer: np.ndarray | None = None
    num_steps: list[int] | None = None  # a multi-step call's decode steps per row, in row order

    @property
    def inputs(self) -> tuple:
        """The step's host inputs, as the variant's executable takes them."""
        head = (self.batch, self.sampling) if self.mask is None else (self.batch, self.sampling, self.mask)
        return head + self.extra

    def sample_slots(self) -> list[int]:
        """Each row's sample's index among its replica's samples (what a placeholder of it names;
        meaningless for rows that do not sample)."""
        L = self.sampling.temperature.shape[1]
        return [at % L for at in self.logit_at.tolist()]


def split_sparse(inputs: tuple) -> tuple[tuple, tuple]:
    """A step's host inputs (RaggedBatch, SamplingTensors, TokenMask, ...) as (the packed part: the
    sampling's SPARSE_FIELDS taken out, those fields); arrays or ShapeDtypeStructs alike."""
    batch, sampling, *rest = inputs
    fields = tuple(getattr(sampling, name) for name in SPARSE_FIELDS)
    return (batch, sampling.replace(**{name: None for name in SPARSE_FIELDS}), *rest), fields


class PendingSamples:
    """A dispatched step's samples on their way to the host (the copy starts at dispatch): the
    engine schedules and dispatches the next step before it asks for them. `out` is what the
    variant fetches (without logprobs when no row asked: each array fetched costs the host ~15-30
    us a step, as long as the rest of a batch-1 step's fetch); `unpack` turns it into each row's
    run. `start_copy` False (a CPU device, whose arrays NumPy reads in place): no copy is started,
    which only cost the host ~7 us an array there."""

    def __init__(
        self, out: Any, packed: StepInputs, unpack: Callable[[Any, StepInputs], StepSamples], start_copy: bool = True
    ):
        self.packed = packed
        self._out = out
        self._unpack = unpack
        if start_copy:
            for leaf in jax.tree.leaves(out):
                leaf.copy_to_host_async()

    @property
    def shape(self) -> tuple:
        """The executable the step ran."""
        return self.packed.shape

    def is_ready(self) -> bool:
        """Whether the step is done (its samples computed), without waiting for it."""
        return all(leaf.is_ready() for leaf in jax.tree.leaves(self._out))

    def wait(self) -> None:
        """Wait until the step is done, fetching nothing."""
        jax.block_until_ready(self._out)

    def result(self) -> StepSamples:
        """Each row's run of samples, in row order (waits for the step)."""
        return self._unpack(jax.device_get(self._out), self.packed)
