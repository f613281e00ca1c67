"""The overlap wrapper's rules for a speculative engine (no model): a step that verifies nothing stays in
flight while the next is dispatched; a step that verifies drafts (serial) is processed before the next
is scheduled; and the step in flight is processed before scheduling one that may draft (its rows draft
from tokens on the host)."""

import types

from jaxserve.engine.in_flight import InFlightStep
from jaxserve.engine.overlap import Overlap


class Pending:
    def __init__(self, n):
        self.n = n
        self.shape = (16, 1)

    def result(self):
        return f"samples{self.n}"


class SpecCore:
    """The EngineCore calls Overlap makes, in order. `plan[n]`: (step n verifies drafts, step n + 1
    may draft), as the speculative decoder would say."""

    def __init__(self, plan, async_scheduling=True):
        self.config = types.SimpleNamespace(async_scheduling=async_scheduling)
        self.can_overlap = True
        self.plan = plan
        self.calls: list[tuple] = []
        self.scheduled = 0

    def needs_host_tokens(self):
        self.calls.append(("asked", self.scheduled + 1))
        return self.plan[self.scheduled][1]

    def schedule(self):
        self.scheduled += 1
        self.calls.append(("schedule", self.scheduled))
        return types.SimpleNamespace(rows=[self.scheduled])

    def execute(self, batch):
        n = batch.rows[0]
        self.calls.append(("execute", n))
        return InFlightStep(batch, [], Pending(n), serial=self.plan[n][0], verifies=self.plan[n][0])

    def samples_under_grammar(self, batch):
        return False

    def update_from_output(self, step):
        step.samples()
        self.calls.append(("update", step.batch.rows[0]))
        return [step.batch.rows[0]]

    def take_outbox(self):
        return []


def test_only_steps_that_verify_nothing_stay_in_flight():
    # step: (verifies drafts, the step after it may draft)
    plan = {
        0: (False, False),
        1: (False, False),
        2: (False, True),
        3: (True, False),
        4: (False, False),
        5: (False, False),
    }
    core = SpecCore(plan)
    overlap = Overlap(core)
    outputs = [overlap.step() for _ in range(5)] + [overlap.flush()]
    assert outputs == [[], [1], [2, 3], [], [4], [5]]
    assert [c for c in core.calls if c[0] != "asked"] == [
        ("schedule", 1), ("execute", 1),
        ("schedule", 2), ("execute", 2), ("update", 1),  # 1 verified nothing: 2 dispatched beside it
        ("update", 2), ("schedule", 3), ("execute", 3), ("update", 3),  # 3 may draft: 2 first, 3 at once
        ("schedule", 4), ("execute", 4),  # nothing in flight to process
        ("schedule", 5), ("execute", 5), ("update", 4),
        ("update", 5),
    ]  # fmt: skip
    # The decoder is asked only while a step is in flight (never about step 1 or step 4).
    assert [n for kind, n in core.calls if kind == "asked"] == [2, 3, 5]


def test_one_deep_without_async_scheduling():
    plan = {n: (n % 2 == 1, False) for n in range(5)}
    core = SpecCore(plan, async_scheduling=False)
    overlap = Overlap(core)
    assert [overlap.step() for _ in range(4)] == [[1], [2], [3], [4]]
    assert not overlap.in_flight and not any(kind == "asked" for kind, _ in core.calls)
