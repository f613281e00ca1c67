"""RunningBatch: the runner's one host description of the running sequences, indexed by slot.

The scheduler gives each running sequence a slot and, each step, sends only what changed
(`jaxserve.engine.scheduler_output.BatchUpdate`: sequences new to the batch, the tokens and pages
the others gained, the slots freed). The batch applies that and reads the step's rows out of its
slots, as `StepRow`s in the step's order, for the variant that runs the step: the plain step lays
them into its persistent `InputBatch` (rewriting only what changed), the others from scratch.
Everything a row needs is here: its tokens (the prompt chunk to compute, the decode's input, the
prompt tokens scored against, the draft model's catch-up), its page table, sampling row, adapter and
grammar; whether it samples and at which output index follow from its tokens.
"""

from __future__ import annotations

import dataclasses
from array import array
from typing import Any

from jaxserve.engine.sequence import token_slice
from jaxserve.runner.step_row import StepRow
from jaxserve.sampling.row import RowSampling


@dataclasses.dataclass(slots=True)
class _Slot:
    replica: int
    prompt: list[int]
    output: list[int]  # up to the last position a row computed
    sampling: RowSampling  # reading `prompt` and `output` (penalties) where they stand
    pages: array  # the page table; a new array whenever entries other than the last ones change
    lora: Any  # the adapter (its device slot read each step: the LoRA manager may move it) or None
    grammar: Any
    scores_prompt: bool
    wants_logprobs: bool


class RunningBatch:
    """Slots of running sequences, kept from step to step. `multi_step`: a row's lookahead is decode
    steps in the same call; `draft_model`: a speculative row names the tokens the draft's cache lacks."""

    def __init__(self, multi_step: bool = False, draft_model: bool = False):
        self.multi_step = multi_step
        self.draft_model = draft_model
        self._slots: dict[int, _Slot] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def apply(self, update: Any) -> list[StepRow]:
        """Apply a step's `BatchUpdate` and return its rows, in the step's order."""
        slots = self._slots
        for slot in update.finished:
            slots.pop(slot, None)
        for new in update.new_rows:
            prompt, output = list(new.token_ids[: new.prompt_len]), list(new.token_ids[new.prompt_len :])
            slots[new.slot] = _Slot(
                new.replica,
                prompt,
                output,
                RowSampling.from_params(new.params, seed=new.seed, step=0, prompt_ids=prompt, output_ids=output),
                array("i", new.page_ids),
                new.lora,
                new.grammar,
                new.scores_prompt,
                new.wants_logprobs,
            )
        rows = []
        for u in update.rows:
            held = slots.get(u.slot)
            if held is None:
                raise KeyError(f"slot {u.slot} is scheduled but the running batch does not hold it")
            if u.tokens is not None:  # past the prompt (what a new row did not bring)
                held.output[u.tokens_from - len(held.prompt) :] = u.tokens
            if u.page_ids is not None:
                if u.pages_from == 0:
                    held.pages = array("i", u.page_ids)
                else:
                    del held.pages[u.pages_from :]
                    held.pages.extend(u.page_ids)
            rows.append(self._row(held, u))
        return rows

    def _row(self, held: _Slot, u: Any) -> StepRow:
        start, end, prompt, output = u.start, u.start + u.num_tokens, held.prompt, held.output
        prompt_len = len(prompt)
        samples = end == prompt_len + len(output)
        targets = None
        if held.scores_prompt and start + 1 < prompt_len:  # the next prompt token of each position
            targets = [prompt[p + 1] if p + 1 < prompt_len else 0 for p in range(start, end)]
        row = StepRow(
            token_slice(prompt, output, start, end),
            start,
            held.pages,
            held.sampling,
            held.replica,
            targets,
            samples,
            held.grammar if samples else None,
            step=len(output),
            pages_version=0,  # the array is replaced whenever its leading entries change
            want_logprobs=held.wants_logprobs,
            lora_slot=-1 if held.lora is None else held.lora.slot,
        )
        if self.multi_step:
            row.num_steps = 1 + u.lookahead
        elif u.drafts is not None:  # a speculative decode row
            k = len(u.drafts)
            if k:
                row.tokens, row.num_drafts = row.tokens + u.drafts, k
            if self.draft_model:  # what the draft's cache lacks, never more tokens than the row has
                lag = u.draft_lag
                tokens = token_slice(prompt, output, start - lag, start - lag + min(lag, k) + 1)
                row.draft_tokens, row.draft_start = tokens, start - lag
        return row

    def clear(self) -> None:
        self._slots.clear()
