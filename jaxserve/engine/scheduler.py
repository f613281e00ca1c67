"""Iteration-level scheduling (no jax): every step re-forms the batch from running and waiting sequences.

One token budget per step (`max_num_batched_tokens`, per replica): running decodes first, one token
each (plus its drafts, with speculative decoding), then prompt chunks of the partially prefilled and
newly admitted sequences in the tokens left, so a prompt never stalls running streams for a step of
its own, and the runner executes the whole mix as one ragged step. (With multi-step decoding a step of
decodes alone runs them several steps in one call; a step holding a prompt chunk is a plain mixed
step, so the prompt rides along there too.) When pages run out mid-decode, the most recently
admitted sequence is preempted: its pages are freed and it is re-queued at the front, to be
recomputed (its output so far is kept).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Iterable

from jaxserve.engine.block_manager import BlockManager, OutOfPagesError
from jaxserve.engine.scheduler_output import BatchTracker, ScheduledRow, SchedulerOutput
from jaxserve.engine.sequence import Sequence, Status


class Scheduler:
    """Owns the waiting queue and the running list; the block manager owns the pages."""

    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        scheduling: str = "continuous",
        preemption_mode: str = "recompute",
        lookahead: Callable[[Sequence, int], int] | None = None,
        lookahead_steps: bool = False,
    ):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs  # per replica
        self.max_num_batched_tokens = max_num_batched_tokens  # the step's budget: `cap_budget`
        self.full_budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.scheduling = scheduling
        self.preemption_mode = preemption_mode
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.num_preemptions = 0
        self._pending_siblings: dict[str, list[Sequence]] = {}  # parent seq_id -> siblings not yet forked
        # How many tokens after its next one a decoding sequence wants: they get pages when free ones
        # exist; a sequence short of pages decodes one token instead. Speculative decoding: drafts to
        # verify, sharing this step's token budget. Multi-step (`lookahead_steps`): later decode steps
        # of one call, outside the budget, and only in a step of decodes alone (the call runs no
        # prompt chunk). A step scoring prompt tokens gets no drafts (it verifies nothing).
        self.lookahead = lookahead  # (sequence, rows in the batch) -> tokens
        self.lookahead_steps = lookahead_steps
        # LoRA: the most adapters the running sequences may use at once (the device slots); None: no LoRA.
        self.max_loras: int | None = None
        # The runner's running batch as sent so far: its slots, and what each step's update says changed.
        self.tracker = BatchTracker(blocks.live_page_ids)
        # A KV connector (jaxserve.kv_transfer.driver.KVConnectorDriver): loads a sequence's pages before it
        # runs, saves them after; it holds the sequences waiting for their KV. None: no connector.
        self.kv: Any = None

    def adapters_in_use(self, waiting: bool = True) -> set:
        """The LoRA adapters (`engine.lora_manager.Adapter`) of the running sequences, and of the
        waiting ones unless `waiting` is False."""
        seqs = (*self.running, *self.waiting) if waiting else self.running
        return {s.lora for s in seqs if s.lora is not None}

    def cap_budget(self, tokens: int) -> None:
        """Cap each step's token budget at `tokens`, the largest token bucket compiled so far (while
        the others compile in the background: runner/background_compile.py); a longer prompt is
        chunked to it. Only ever raised, up to the configured budget, so a step scheduled under an
        older cap still fits a ready bucket."""
        self.max_num_batched_tokens = min(self.full_budget, tokens)

    # ---- queue management ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence at once: it leaves the batch and its pages return to the pool."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
        self.tracker.release(seq)
        if seq in self.running:
            self.running.remove(seq)
            if self.kv is None or not self.kv.finished(seq):  # a connector may keep them until saved
                self.blocks.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif self.kv is not None:
            self.kv.dropped(seq)  # aborted while its KV was loading

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decodes first (one token each; preempting when pages run out), then prompt chunks, each
        replica within its own token budget."""
        copies = self._fork_ready_parents()
        decoding = [s for s in self.running if s.compute_target - s.num_computed == 1 and self._can_run(s)]
        rows, preempted = self._schedule_decode(decoding)
        if self.lookahead is not None and not self.lookahead_steps:  # drafts: in the budget
            self._give_lookahead(
                rows,
                [
                    self.max_num_batched_tokens - sum(r.seq.replica == rep for r in rows)
                    for rep in range(self.blocks.num_replicas)
                ],
            )
        decodes = len(rows)
        rows += self._prompt_chunks(rows)
        if not rows:
            return SchedulerOutput("idle", [], copies, preempted)
        if decodes and self.lookahead is not None and not self.lookahead_steps and any(r.scores_prompt for r in rows):
            for row in rows[:decodes]:  # their pages stay reserved: the sequences decode on
                row.num_lookahead = 0
        if self.lookahead is not None and self.lookahead_steps and len(rows) == decodes:
            self._give_lookahead(rows, [self.max_model_len] * self.blocks.num_replicas)  # later steps
        kind = "decode" if len(rows) == decodes else "prefill" if not decodes else "mixed"
        return SchedulerOutput(kind, rows, copies, preempted, self.tracker.emit(rows))

    def takes_arrivals(self, batch: SchedulerOutput) -> bool:
        """Whether a request arriving now could still join `batch` (`top_up`): nobody waits ahead of
        it, and some replica has a free seat and tokens left in the batch's budget."""
        if (
            not batch.rows
            or self.waiting
            or self.lookahead is not None
            or (self.scheduling == "static" and self.running)
            or self._prompt_work_in_flight() >= self.max_num_batched_tokens
        ):
            return False
        budget, seats = self._budget_left(batch.rows), self._seats_left()
        return any(b > 0 and n > 0 for b, n in zip(budget, seats))

    def top_up(self, batch: SchedulerOutput) -> list[ScheduledRow]:
        """Admit requests added since `batch` was made and append their first prompt chunks to it, in
        the budget it left; returns the rows added. Async scheduling holds a batch back for requests
        that arrive while the step before it runs (engine/overlap.py); a batch with lookahead is never
        topped up (only plain steps are held back)."""
        new = self._prompt_chunks(batch.rows)
        if new:
            batch.update = self.tracker.emit(new, batch.update)
            batch.rows.extend(new)
            batch.kind = "prefill" if batch.kind == "prefill" else "mixed"
        return new

    def _prompt_chunks(self, rows: list[ScheduledRow]) -> list[ScheduledRow]:
        """Admit from the queue, then a chunk of each running prompt not in `rows`, in the tokens
        `rows` leave of each replica's budget (admission order: partially prefilled prompts first)."""
        budget = self._budget_left(rows)
        if self.waiting and not (self.scheduling == "static" and self.running):
            self._admit_waiting(self._prompt_work_in_flight())
        scheduled = {id(r.seq) for r in rows}
        chunks = []
        for seq in self.running:
            if id(seq) in scheduled:
                continue
            chunk = min(seq.compute_target - seq.num_computed, budget[seq.replica])
            if chunk < 1 or not self._can_run(seq):
                continue
            chunks.append(ScheduledRow(seq, seq.num_computed, chunk))
            budget[seq.replica] -= chunk
        return chunks

    def _budget_left(self, rows: list[ScheduledRow]) -> list[int]:
        budget = [self.max_num_batched_tokens] * self.blocks.num_replicas
        for row in rows:
            budget[row.seq.replica] -= row.num_tokens + row.num_lookahead
        return budget

    def _prompt_work_in_flight(self) -> int:
        """Prompt tokens the running sequences have still to compute."""
        return sum(s.compute_target - s.num_computed for s in self.running if s.compute_target - s.num_computed > 1)

    def _seats_left(self) -> list[int]:
        """Free sequence slots per replica for the step being scheduled (siblings still to fork hold
        theirs). A sequence that ends when its token in flight lands (`_can_run`: its length ends
        it) takes no row in this step, so its seat is free already: async scheduling would otherwise
        keep a queued request out for one step more than a serial engine does."""
        seats = [self.max_num_seqs] * self.blocks.num_replicas
        for s in self.running:
            if s.in_flight and not self._can_run(s):
                continue
            seats[s.replica] -= 1 + s.num_siblings_to_fork
        return seats

    def _can_run(self, seq: Sequence) -> bool:
        """Whether `seq` may join a step scheduled while its last token is still in flight (async
        scheduling): not if its length ends it once the token lands (max_tokens, max_model_len:
        there is nothing left to compute). A row under a grammar may: the engine hands its grammar
        that token before the row's next mask is filled (Overlap.step)."""
        if not seq.in_flight:
            return True
        return len(seq.output_token_ids) < seq.params.max_tokens and seq.num_tokens < self.max_model_len

    def _fork_ready_parents(self) -> list[tuple[int, int, int]]:
        """A parent that computed all but its last prompt token forks its n - 1 siblings now.

        Each sibling needs a page of its own when the prompt ends inside a page; if the replica lacks
        them, the most recently admitted other sequences there are preempted (as a decode step would).
        Admission checked that the prompt plus one page per sibling fits an empty replica."""
        copies = []
        for parent in [s for s in self.running if s.num_siblings_to_fork and s.num_pending == 1]:
            children = self._pending_siblings.pop(parent.seq_id, [])[: parent.num_siblings_to_fork]
            parent.num_siblings_to_fork = 0
            need = len(children) if parent.num_computed % self.blocks.page_size else 0
            while self.blocks.num_free_pages(parent.replica) < need:
                others = [s for s in self.running if s is not parent and s.replica == parent.replica]
                if not others:
                    raise OutOfPagesError(
                        f"replica {parent.replica}: no pages to fork {len(children)} samples of "
                        f"{parent.seq_id!r} with nothing left to preempt"
                    )
                self._preempt(others[-1])
            for child in children:
                pairs = self.blocks.fork(parent.seq_id, child.seq_id)
                copies += [(parent.replica, src, dst) for src, dst in pairs]
                child.num_computed = parent.num_computed
                child.replica = parent.replica
                child.status = Status.RUNNING
                self.running.append(child)
        return copies

    def add_siblings(self, parent: Sequence, siblings: Iterable[Sequence]) -> None:
        """Siblings of an n > 1 request wait for their parent's prompt and then share its pages."""
        self._pending_siblings[parent.seq_id] = list(siblings)

    def drop_siblings(self, parent: Sequence) -> list[Sequence]:
        return self._pending_siblings.pop(parent.seq_id, [])

    def _admit_waiting(self, pending_tokens: int) -> None:
        """Admit from the head of the queue, first come first served (nobody overtakes the head).

        Continuous: while the prompt work in flight is under one step's token budget, so admitted
        sequences do not sit on pages for long before they run. Static: everything that fits, once.
        With LoRA, a sequence whose adapter would be one more than `max_loras` among the running ones
        is passed over (as vLLM does) until one of theirs finishes; the others keep their order.
        """
        static = self.scheduling == "static"
        adapters = None if self.max_loras is None else self.adapters_in_use(waiting=False)
        passed_over = 0
        while len(self.waiting) > passed_over and (static or pending_tokens < self.max_num_batched_tokens):
            seq = self.waiting[passed_over]
            if (
                adapters is not None
                and seq.lora is not None
                and seq.lora not in adapters
                and len(adapters) >= self.max_loras
            ):
                passed_over += 1
                continue
            # Preempted with its token in flight (async scheduling): it waits until that token is on
            # the host. Its placeholder names a sample of its old replica's step, which another
            # replica's step would resolve from its own samples: a wrong id, and wrong K/V after it.
            if seq.in_flight or self._admit(seq) is None:
                break
            del self.waiting[passed_over]
            if adapters is not None and seq.lora is not None:
                adapters.add(seq.lora)
            pending_tokens += seq.compute_target - seq.num_computed

    def _admit(self, seq: Sequence) -> int | None:
        """Give the head of the queue pages on the best replica, or None if none can take it now."""
        tokens = seq.tokens
        reuse = seq.params.prompt_logprobs is None  # prompt logprobs need every position computed
        root = seq.prefix_root  # the prefix cache's chain start: each adapter's own
        width = 1 + seq.num_siblings_to_fork
        seats = self._seats_left()  # siblings still to fork will run on their parent's replica
        best, best_key = None, None
        for r in range(self.blocks.num_replicas):
            if seats[r] < width:
                continue
            if self.preemption_mode == "reserve":
                need = width * self.blocks.pages_for(self._reserved_tokens(seq))
                if self.blocks.num_free_pages(r) < need:
                    continue
            elif not self.blocks.can_admit(r, len(tokens), tokens if reuse else None, root):
                continue
            # Prefer the replica holding this prefix, then the emptiest (most free pages, fewest sequences).
            key = (self.blocks.lookup_prefix(r, tokens, root) if reuse else 0, self.blocks.num_free_pages(r), seats[r])
            if best_key is None or key > best_key:
                best, best_key = r, key
        if best is None:
            return None
        seq.num_computed = self.blocks.admit(seq.seq_id, best, tokens, reuse_prefix=reuse, root=root)
        if self.preemption_mode == "reserve":
            self.blocks.ensure_capacity(seq.seq_id, self._reserved_tokens(seq))
        seq.replica = best
        seq.status = Status.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        if self.kv is not None and reuse and self.kv.admitted(seq):
            return best  # its KV is on the way: it waits in self.kv.loading, holding its pages
        self.running.append(seq)
        return best

    def _reserved_tokens(self, seq: Sequence) -> int:
        return min(len(seq.prompt_token_ids) + seq.params.max_tokens, self.max_model_len)

    def _schedule_decode(self, decoding: list[Sequence]) -> tuple[list[ScheduledRow], list[Sequence]]:
        rows, preempted = [], []
        for seq in decoding:
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            self.blocks.release_outside_window(seq.seq_id)  # pages no layer's window reads again (Mistral)
            while not self.blocks.ensure_capacity(seq.seq_id, seq.num_tokens):
                # The newest sequence on this replica: only its pages can make room here.
                victim = [s for s in self.running if s.replica == seq.replica][-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                rows.append(ScheduledRow(seq, seq.num_computed, 1))
        return [r for r in rows if r.seq.status is Status.RUNNING], preempted

    def _give_lookahead(self, rows: list[ScheduledRow], spare: list[int]) -> None:
        """Lookahead tokens for decode rows, within each replica's `spare` tokens, where pages for them
        are free: after every row has its own page, so lookahead never preempts."""
        for row in rows:
            extra = min(self.lookahead(row.seq, len(rows)), spare[row.seq.replica])
            if extra > 0 and self.blocks.ensure_capacity(row.seq.seq_id, row.seq.num_tokens + extra):
                row.num_lookahead = extra
                spare[row.seq.replica] -= extra

    def _preempt(self, seq: Sequence) -> None:
        """Free all of a sequence's pages and queue it first; it is recomputed from its tokens later."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        self.tracker.release(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.replica = None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
