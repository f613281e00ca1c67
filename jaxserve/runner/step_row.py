"""StepRow: one row of a step as the variants lay it out. The runner makes them from its running
batch (`runner.running_batch`) for the engine's steps; research code and benchmarks that run steps
of their own rows (`ModelRunner.execute_rows`) make them directly."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jaxserve.sampling.row import RowSampling


@dataclasses.dataclass
class StepRow:
    """One sequence's share of a step: compute `tokens` starting at `start_pos`; sample one token
    after them unless `samples` is False (a prompt chunk that does not end its prompt)."""

    tokens: Sequence[int]
    start_pos: int
    page_ids: Sequence[int]
    sampling: RowSampling | None = None  # None: greedy
    replica: int = 0
    # With prompt logprobs: the token after each of `tokens` (what its logits are scored against).
    targets: Sequence[int] | None = None
    samples: bool = True
    # Structured output: the sequence's GrammarMatcher (jaxserve.structured), whose mask constrains
    # this row's sample; None: unconstrained.
    grammar: Any = None
    step: int | None = None  # the output index this row samples, in place of sampling.step
    # Multi-step decoding: the decode steps this row takes in the call (its pages hold them all).
    num_steps: int = 1
    # Speculative decoding: the last `num_drafts` of `tokens` are drafts to verify (zeros where the
    # draft model proposes them in the step), and the tokens the draft model's cache lacks, ending
    # at this row's last token before the drafts, from position `draft_start` (None: the row's own).
    num_drafts: int = 0
    draft_tokens: Sequence[int] | None = None
    draft_start: int = 0
    want_logprobs: bool = False  # speculative steps: the row returns logprobs (computed only if one does)
    # With `page_ids` the block manager's live table (`BlockManager.live_page_ids`): its version. The
    # same table object at the same version holds the same leading entries, so a step whose row holds
    # it again does not rewrite them (`InputBatch`); None: rewritten every step.
    pages_version: int | None = None
    # LoRA: the device slot of the row's adapter (`engine.lora_manager`); -1 for the base model.
    lora_slot: int = -1
