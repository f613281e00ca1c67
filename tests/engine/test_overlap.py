"""The overlap wrapper (engine/overlap.py) over a stand-in core that records its calls: how deep steps
stay in flight (async scheduling on, off, switched off mid-run, a core whose steps may not overlap),
and that a grammar's previous tokens reach the core as data before the next step is packed. And the
scheduler's own decision that a step scoring prompt tokens verifies no drafts. No model: milliseconds."""

from __future__ import annotations

import time
import types

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.in_flight import InFlightStep
from jaxserve.engine.overlap import Overlap
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence
from jaxserve.sampling.params import SamplingParams


class Pending:
    """A dispatched step's samples, done at once (the runner's PendingSamples)."""

    shape = (8, 1)

    def __init__(self, n: int):
        self.n = n

    def result(self):
        return f"samples{self.n}"


class RecordingCore:
    """The EngineCore calls Overlap makes, recorded in order: step n's batch is [n]."""

    def __init__(self, async_scheduling=True, can_overlap=True, constrained=False):
        self.config = types.SimpleNamespace(async_scheduling=async_scheduling)
        self.can_overlap, self.constrained = can_overlap, constrained
        self.grammar_rows_next = True  # the next batch has a row sampling under a grammar
        self.calls: list[tuple] = []
        self.scheduled = 0

    def has_unfinished_requests(self):
        return True

    def schedule(self):
        self.scheduled += 1
        self.calls.append(("schedule", self.scheduled))
        return types.SimpleNamespace(rows=[self.scheduled])

    def execute(self, batch):
        n = batch.rows[0]
        self.calls.append(("execute", n))
        return InFlightStep(
            batch, [], Pending(n), serial=False, constrained=self.constrained, dispatched_at=time.perf_counter()
        )

    def needs_host_tokens(self):  # a speculative engine's next step may draft: not here
        return False

    def samples_under_grammar(self, batch):
        return self.constrained and self.grammar_rows_next

    def advance_grammars(self, step, samples):
        self.calls.append(("grammar", step.batch.rows[0], samples))

    def update_from_output(self, step):
        self.calls.append(("update", step.batch.rows[0], step.samples()))
        return [f"out{step.batch.rows[0]}"]

    def take_outbox(self):
        return []


def test_async_scheduling_dispatches_the_next_step_before_processing_the_last():
    core = RecordingCore()
    overlap = Overlap(core)
    assert overlap.step() == [] and core.calls == [("schedule", 1), ("execute", 1)]  # 1 in flight
    assert overlap.step() == ["out1"]
    assert core.calls[2:] == [("schedule", 2), ("execute", 2), ("update", 1, "samples1")]
    assert overlap.flush() == ["out2"] and not overlap.in_flight and overlap.has_unfinished_requests()


def test_one_step_deep_without_async_scheduling_or_when_steps_may_not_overlap():
    for core in (RecordingCore(async_scheduling=False), RecordingCore(can_overlap=False)):
        overlap = Overlap(core)
        assert overlap.depth == 1
        assert overlap.step() == ["out1"]
        assert core.calls == [("schedule", 1), ("execute", 1), ("update", 1, "samples1")]


def test_a_step_left_in_flight_is_processed_first_once_async_scheduling_is_off():
    core = RecordingCore()
    overlap = Overlap(core)
    overlap.step()
    overlap.async_scheduling = False
    assert overlap.step() == ["out1", "out2"]
    assert core.calls[2:] == [("update", 1, "samples1"), ("schedule", 2), ("execute", 2), ("update", 2, "samples2")]


def test_the_grammars_take_the_previous_samples_before_the_next_step_is_packed():
    """Rows under a grammar: step 2's masks follow step 1's tokens, handed to the core as data
    before step 2 is executed (packed); never held back for arrivals (the core has no scheduler
    here: a hold-back would fail)."""
    core = RecordingCore(constrained=True)
    overlap = Overlap(core, arrivals=True)
    overlap.step()
    assert overlap.step() == ["out1"]
    assert core.calls[2:] == [("schedule", 2), ("grammar", 1, "samples1"), ("execute", 2), ("update", 1, "samples1")]


def test_no_wait_for_the_grammars_when_no_constrained_row_samples_next():
    """A step after a constrained one, with no row sampling under a grammar: dispatched without
    waiting for the step in flight (those grammars take their tokens at its update)."""
    core = RecordingCore(constrained=True)
    core.grammar_rows_next = False
    overlap = Overlap(core)
    overlap.step()
    assert overlap.step() == ["out1"]
    assert core.calls[2:] == [("schedule", 2), ("execute", 2), ("update", 1, "samples1")]


def test_a_step_scoring_prompt_tokens_gets_no_drafts():
    """Speculation cannot verify in a step that scores prompt tokens (prompt logprobs): the scheduler
    gives its decode rows no drafts (their pages stay reserved); without the scoring row, it does."""
    for scores in (False, True):
        blocks = BlockManager(40, 4, 1)
        s = Scheduler(blocks, 4, 32, 64, lookahead=lambda seq, batch_size: 2)
        a = Sequence(
            seq_id="a",
            request_id="a",
            index=0,
            prompt_token_ids=[10, 11, 12, 13, 14],
            params=SamplingParams(max_tokens=8),
            seed=0,
        )
        s.add(a)
        s.schedule()
        a.num_computed = 5
        a.output_token_ids.append(3)
        b = Sequence(
            seq_id="b",
            request_id="b",
            index=0,
            prompt_token_ids=list(range(20, 30)),
            params=SamplingParams(max_tokens=8, prompt_logprobs=1 if scores else None),
            seed=0,
        )
        if scores:
            b.prompt_logprobs = [None] * 10
        s.add(b)
        plan = s.schedule()
        rows = {r.seq.seq_id: r for r in plan.rows}
        assert plan.kind == "mixed" and rows["b"].scores_prompt == scores
        assert rows["a"].num_lookahead == (0 if scores else 2)
