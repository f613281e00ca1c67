"""What a step is, as the scheduler emits it: which rows run, and what changed since the step before.

The runner keeps one persistent, slot-indexed description of the running sequences
(`jaxserve.runner.running_batch.RunningBatch`); each running sequence owns a slot from the step that
first schedules it until it finishes or is preempted. A step's `BatchUpdate` tells the runner only
what it does not know yet, as vLLM V1's `SchedulerOutput` does:

* `new_rows`: sequences new to the batch (admitted, forked, or back after a preemption): their
  tokens so far, sampling parameters and seed, adapter, grammar and page table, once;
* `rows`: every row the step runs, in order: its slot, the positions it computes, the tokens
  appended since it last ran (a decode's one new token, or the run a multi-step or speculative step
  emitted) and its page-table entries added (or the whole table, when it changed otherwise);
* `finished`: the slots freed since the last update (finished, aborted, preempted sequences).

A token reaches the batch when a row first computes it. A decode's input token may then be a
placeholder of the step in flight (`jaxserve.model.ragged.placeholder`), which the device resolves;
the row's next update sends that position again, by then the id it resolved to. So the batch's copy
of a sequence's tokens equals the sequence's at every step it runs (what penalties read, and what
multi-host followers rebuild the step from).

`ScheduledRow`s (the sequences themselves) stay with the engine core for its bookkeeping; the runner
reads only the update.
"""

from __future__ import annotations

import dataclasses
import heapq
from array import array
from typing import Any, Callable

from jaxserve.engine.sequence import Sequence, token_slice
from jaxserve.model.ragged import is_placeholder
from jaxserve.sampling.params import SamplingParams


@dataclasses.dataclass
class ScheduledRow:
    seq: Sequence
    start: int  # first token computed this step (= seq.num_computed when scheduled)
    num_tokens: int
    # Tokens after it whose pages are allocated: speculative decoding's drafts to verify (in this
    # step), or multi-step's later decode steps (in the same call).
    num_lookahead: int = 0

    @property
    def samples(self) -> bool:
        """The row reaches the sequence's last token, so its logits give the next one."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def scores_prompt(self) -> bool:
        """The row has prompt tokens to score (prompt logprobs): its step is a scoring step."""
        return self.seq.prompt_logprobs is not None and self.start + 1 < len(self.seq.prompt_token_ids)


@dataclasses.dataclass(slots=True)
class NewRow:
    """A sequence the runner's batch does not hold yet, whole."""

    slot: int
    replica: int
    token_ids: list[int]  # prompt + output so far
    prompt_len: int
    params: SamplingParams
    seed: int  # the sequence's random stream (`Sequence.seed`)
    page_ids: array  # its page table as the block manager holds it now (the runner copies it)
    lora: Any = None  # its LoRA adapter (`engine.lora_manager.Adapter`: its device slot read each step)
    grammar: Any = None  # structured output: its GrammarMatcher, constraining the rows that sample
    scores_prompt: bool = False  # prompt logprobs: its prompt chunks score every token against the next
    wants_logprobs: bool = False  # its samples return logprobs (speculative steps compute them per row)


@dataclasses.dataclass(slots=True)
class RowUpdate:
    """One row of a step: compute tokens [start, start + num_tokens) of the sequence in `slot`."""

    slot: int
    start: int
    num_tokens: int
    lookahead: int = 0  # ScheduledRow.num_lookahead
    tokens_from: int = 0  # where `tokens` go in the slot's tokens
    tokens: list[int] | None = None  # tokens appended since it last ran; None: nothing new
    pages_from: int = 0  # where `page_ids` go in the slot's page table (0: the whole table anew)
    page_ids: Any = None  # page ids added; None: unchanged
    # Speculative decoding (`spec_decode.SpeculativeDecoder.prepare`): the drafts this row verifies
    # (zeros where the draft model proposes them in the step; None: a prompt chunk, which verifies
    # nothing), and how many tokens the draft model's cache lags behind the row's.
    drafts: list[int] | None = None
    draft_lag: int = 0


@dataclasses.dataclass
class BatchUpdate:
    """What the runner applies to its running batch before running the step (see the module doc)."""

    new_rows: list[NewRow]
    rows: list[RowUpdate]
    finished: list[int]
    logprobs: bool = False  # a row asked for logprobs: the step's are fetched


@dataclasses.dataclass
class SchedulerOutput:
    kind: str  # "prefill" | "decode" | "mixed" (prompt chunks and sampling decodes) | "idle"
    rows: list[ScheduledRow]
    page_copies: list[tuple[int, int, int]]  # (replica, src, dst) to copy before the step (forks)
    preempted: list[Sequence]
    update: BatchUpdate | None = None  # made by `BatchTracker.emit` (None for an idle step)


@dataclasses.dataclass(slots=True)
class _Held:
    """What the runner's batch holds of one sequence: its slot, how many of its tokens, and its page
    table as last sent (the block manager's array, its version, how many entries)."""

    slot: int
    num_tokens: int
    pages: array
    pages_version: int
    num_pages: int
    unresolved: int | None = None  # the position last sent as a placeholder: sent again once resolved


class BatchTracker:
    """The scheduler's record of the runner's batch: assigns slots and turns scheduled rows into the
    step's `BatchUpdate`. `page_table(seq_id)` is the block manager's `live_page_ids`."""

    def __init__(self, page_table: Callable[[str], tuple[array, int]]):
        self._page_table = page_table
        self._held: dict[str, _Held] = {}
        self._free: list[int] = []  # a heap: the lowest free slot is reused first
        self._next_slot = 0
        self._finished: list[int] = []

    @property
    def num_slots(self) -> int:
        """Slots handed out so far (the largest batch held at once)."""
        return self._next_slot

    def release(self, seq: Sequence) -> None:
        """The sequence left the batch (finished, aborted, preempted): its slot is free from the next
        update on."""
        held = self._held.pop(seq.seq_id, None)
        if held is not None:
            heapq.heappush(self._free, held.slot)
            self._finished.append(held.slot)

    def emit(self, rows: list[ScheduledRow], update: BatchUpdate | None = None) -> BatchUpdate:
        """The update for these rows (appended to `update`, when rows join a step already emitted)."""
        if update is None:
            update = BatchUpdate([], [], self._finished)
            self._finished = []
        new_rows, out = update.new_rows, update.rows
        for row in rows:
            seq = row.seq
            end = row.start + row.num_tokens
            update.logprobs |= seq.params.logprobs is not None
            held = self._held.get(seq.seq_id)
            pages, version = self._page_table(seq.seq_id)
            if held is None:
                held = self._hold(seq, pages, version)
                new_rows.append(
                    NewRow(
                        held.slot,
                        seq.replica,
                        list(seq.token_view),
                        len(seq.prompt_token_ids),
                        seq.params,
                        seq.seed,
                        pages,
                        seq.lora,
                        seq.grammar,
                        seq.prompt_logprobs is not None,
                        seq.params.logprobs is not None,
                    )
                )
                out.append(RowUpdate(held.slot, row.start, row.num_tokens, row.num_lookahead))
                continue
            entry = RowUpdate(held.slot, row.start, row.num_tokens, row.num_lookahead)
            lo = held.num_tokens if held.unresolved is None else held.unresolved
            if end > lo:  # a decode's input token (after a run: the run's tokens too)
                tokens = entry.tokens = token_slice(seq.prompt_token_ids, seq.output_token_ids, lo, end)
                entry.tokens_from, held.num_tokens = lo, max(held.num_tokens, end)
                held.unresolved = end - 1 if is_placeholder(tokens[-1]) else None
            if pages is not held.pages or version != held.pages_version:  # a new table: whole
                entry.page_ids = pages
                held.pages, held.pages_version, held.num_pages = pages, version, len(pages)
            elif len(pages) != held.num_pages:  # pages appended
                entry.pages_from, entry.page_ids = held.num_pages, pages[held.num_pages :]
                held.num_pages = len(pages)
            out.append(entry)
        return update

    def _hold(self, seq: Sequence, pages: array, version: int) -> _Held:
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        held = self._held[seq.seq_id] = _Held(slot, seq.num_tokens, pages, version, len(pages))
        return held
