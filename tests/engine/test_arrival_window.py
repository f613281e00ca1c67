"""Async scheduling holds step N+1 back for requests that arrive while step N runs, so that they join
N+1 instead of waiting for N+2 (engine/arrival_window.py): the window's estimate, the scheduler's
top-up, the intake's taking of arrivals, and an engine whose late request joins the held step with
outputs unchanged."""

import threading
import time
import types

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.arrival_window import MIN_MARGIN_S, MIN_SAMPLES, ArrivalWindow
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.config import EngineConfig
from jaxserve.engine.core import EngineCore
from jaxserve.engine.intake import Abort, Intake
from jaxserve.engine.overlap import Overlap
from jaxserve.engine.processor import EngineRequest
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence, Status
from jaxserve.model.ragged import placeholder

from engine_testlib import StepRecorder

GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------- the estimate
def test_the_window_closes_a_margin_before_the_step_in_flight_should_end():
    w = ArrivalWindow()
    w.dispatched(0.0002)
    t = 100.0
    for _ in range(MIN_SAMPLES):  # back to back: each step starts when the one before ends
        assert w.closes_at(8, t - 0.01) is None  # fewer than MIN_SAMPLES times of the bucket
        w.done(8, dispatched_at=t - 0.01, seen_at=t + 0.030)
        t += 0.030
    assert w.closes_at(16, t - 0.01) is None  # another bucket: not known yet
    closes = w.closes_at(8, dispatched_at=t - 0.01)  # dispatched before the last ended: starts at t
    assert closes == pytest.approx(t + 0.030 - max(MIN_MARGIN_S, 3 * 0.0002))
    # dispatched after the last step ended (the engine was idle): it starts at its dispatch
    assert w.closes_at(8, dispatched_at=t + 5) == pytest.approx(t + 5 + 0.030 - max(MIN_MARGIN_S, 0.0006))


# ---------------------------------------------------------------- the scheduler's top-up
def _scheduler(max_num_seqs=4, budget=16, scheduling="continuous"):
    blocks = BlockManager(40, 4, 1)
    return Scheduler(blocks, max_num_seqs, budget, 64, scheduling=scheduling)


def _seq(name, prompt_len):
    return Sequence(
        seq_id=name,
        request_id=name,
        index=0,
        prompt_token_ids=list(range(10, 10 + prompt_len)),
        params=SamplingParams(max_tokens=8),
        seed=0,
    )


def _decoding(scheduler, names):
    """Sequences with their prompts computed and a token sampled: each decodes one token a step."""
    seqs = [_seq(n, 5) for n in names]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()
    for seq in seqs:
        seq.num_computed = 5
        seq.output_token_ids.append(3)
    return seqs


def test_an_arrival_joins_the_held_plan_in_the_tokens_it_left():
    s = _scheduler()
    _decoding(s, ["a", "b"])
    plan = s.schedule()
    assert plan.kind == "decode" and len(plan.rows) == 2
    assert s.takes_arrivals(plan)
    late = _seq("late", 30)
    s.add(late)
    joined = s.top_up(plan)
    assert [(r.seq.seq_id, r.start, r.num_tokens) for r in joined] == [("late", 0, 14)]  # 16 - 2 decodes
    assert plan.kind == "mixed" and plan.rows[-1] is joined[0]
    assert s.top_up(plan) == []  # nothing more: the budget is spent
    assert not s.takes_arrivals(plan)


def test_no_window_when_an_arrival_could_not_join():
    s = _scheduler(max_num_seqs=2)
    _decoding(s, ["a", "b"])
    assert not s.takes_arrivals(s.schedule())  # no free seat
    s = _scheduler()
    _decoding(s, ["a"])
    blocked = _seq("blocked", 4)
    s.waiting.append(blocked)  # somebody waits already (here: never admitted); an arrival queues behind
    assert not s.takes_arrivals(types.SimpleNamespace(rows=[object()]))
    s.waiting.clear()
    static = _scheduler(scheduling="static")
    _decoding(static, ["a"])
    assert not static.takes_arrivals(static.schedule())  # static batching admits only into an empty batch


def test_a_seat_freed_by_a_token_in_flight_is_given_in_the_step_scheduled_beside_it():
    """A sequence whose token in flight is its last (max_tokens) takes no row in the next step, so a
    queued request takes its seat there instead of a step later."""
    s = _scheduler(max_num_seqs=2)
    a, b = _decoding(s, ["a", "b"])
    a.params = SamplingParams(max_tokens=2)
    a.output_token_ids[-1] = placeholder(0)  # its 2nd token: in flight, and then it ends
    a.output_token_ids.insert(0, 4)
    b.output_token_ids[-1] = placeholder(1)  # b goes on
    queued = _seq("queued", 6)
    s.add(queued)
    plan = s.schedule()
    assert {r.seq.seq_id: r.num_tokens for r in plan.rows} == {"b": 1, "queued": 6}
    assert len(plan.rows) <= 2  # still at most max_num_seqs rows


# ---------------------------------------------------------------- the intake
class FakeStep:
    """A step in flight (PendingSamples' is_ready and wait) that ends when `done` is set."""

    def __init__(self, done=False):
        self.done = threading.Event()
        if done:
            self.done.set()

    def is_ready(self):
        return self.done.is_set()

    def wait(self):
        self.done.wait()


def _recording_overlap():
    """The overlap wrapper over an EngineCore with only its intake: the core records what the
    wrapper's `_wait_for_arrivals` admits."""
    core = EngineCore.__new__(EngineCore)
    core.intake, core.added, core.config, core.spec = Intake(), [], EngineConfig(), None
    core._admit_queued = lambda request: core.added.append(request.request_id) or True
    return Overlap(core, arrivals=True)


def test_arrivals_are_taken_up_to_an_abort_and_the_wait_ends_when_one_comes_or_the_step_ends():
    overlap = _recording_overlap()
    core, intake = overlap.core, overlap.core.intake
    params = SamplingParams()
    for item in [EngineRequest("a", [1], params), Abort("x"), EngineRequest("b", [2], params)]:
        intake.put(item)
    first = FakeStep()
    assert overlap._wait_for_arrivals(first, time.perf_counter() + 5) == 1
    assert core.added == ["a"] and intake.take_all()[0] == Abort("x")  # left for the next take_all
    first.done.set()  # the watcher waits for each step in turn, as they end on the device
    steps = [FakeStep() for _ in range(3)]
    start = time.perf_counter()
    assert overlap._wait_for_arrivals(steps[0], start + 0.05) == 0  # nothing came: until `until`
    assert 0.045 < time.perf_counter() - start < 1
    steps[0].done.set()
    start = time.perf_counter()
    assert overlap._wait_for_arrivals(FakeStep(done=True), start + 5) == 0  # the step in flight is done: no wait
    assert time.perf_counter() - start < 0.5

    def later(action):
        def run():
            time.sleep(0.05)
            action()

        threading.Thread(target=run).start()

    later(steps[1].done.set)  # the step ends: the watcher wakes the wait
    start = time.perf_counter()
    assert overlap._wait_for_arrivals(steps[1], start + 5) == 0
    assert time.perf_counter() - start < 1

    later(lambda: intake.put(EngineRequest("c", [3], params)))
    start = time.perf_counter()
    assert overlap._wait_for_arrivals(steps[2], start + 5) == 1
    assert core.added == ["a", "c"] and time.perf_counter() - start < 1
    steps[2].done.set()
    intake.close()
    overlap.close()
    overlap._watcher.join(1)
    assert not overlap._watcher.is_alive()


def test_an_offline_engine_never_holds_a_step_back():
    """Only an intake another thread feeds (AsyncLLMEngine's) is waited on: offline, nobody arrives."""
    core = _recording_overlap().core
    assert not Overlap(core).arrivals  # LLM.generate's
    assert AsyncLLMEngine(core).overlap.arrivals  # the front feeds the intake from other threads


# ---------------------------------------------------------------- the engine
def test_a_request_arriving_while_a_step_runs_joins_the_next_one():
    """Two streams decode; a request arrives while a step is held back: its first prompt chunk is in
    that very step, and every output equals its request run alone."""
    with LLM(
        "checkpoints/small",
        dtype="float32",
        page_size=8,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        warm_up=False,
    ) as llm:
        engine, overlap = llm.engine, llm.overlap
        assert overlap.async_scheduling
        calls = []
        late_prompt = list(range(40, 80))

        def arrivals(in_flight, until):
            calls.append(until)
            if len(calls) == 1:
                engine.add_request("late", None, SamplingParams(max_tokens=6, **GREEDY), late_prompt)
                return 1
            return 0

        prompts = {"a": list(range(5, 17)), "b": list(range(100, 107))}
        with StepRecorder(engine, overlap) as rec:
            for name, prompt in prompts.items():
                engine.add_request(name, None, SamplingParams(max_tokens=30, **GREEDY), prompt)
            for _ in range(MIN_SAMPLES + 3):  # decodes in one bucket, times for its estimate
                rec.step()
            overlap.arrivals = True
            overlap._wait_for_arrivals = arrivals
            rec.step()
            assert len(calls) == 1  # held back (how long is the host's timing, not asserted)
            held = rec.plans[-1]
            by_id = {r.seq.request_id: r for r in held.rows}
            assert held.kind == "mixed" and by_id["late"].start == 0 and by_id["late"].num_tokens == 30
            assert by_id["a"].num_tokens == by_id["b"].num_tokens == 1
            while overlap.has_unfinished_requests():
                rec.step()
            outputs = rec.token_ids()
        for name, prompt, n in [("a", prompts["a"], 30), ("b", prompts["b"], 30), ("late", late_prompt, 6)]:
            alone = llm.generate(
                prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False
            )
            assert outputs[name] == alone[0].outputs[0].token_ids, name
        assert llm.blocks.num_free_pages(0) == llm.blocks.num_usable_pages
        llm.blocks.check_invariants()


def test_a_sequence_preempted_with_its_token_in_flight_waits_for_that_token():
    """Re-admitted in the same schedule, it could land on another replica, whose step resolves its
    placeholder from that replica's samples (a wrong id: the two-replica greedy test caught it)."""
    s = _scheduler()
    (a,) = _decoding(s, ["a"])
    a.output_token_ids[-1] = placeholder(0)
    s._preempt(a)
    assert s.waiting[0] is a and a.in_flight
    plan = s.schedule()
    assert plan.rows == [] and a.status is not Status.RUNNING  # not admitted while its token is in flight
    a.output_token_ids[-1] = 3  # processed: the id is on the host
    plan = s.schedule()
    assert [(r.seq.seq_id, r.start, r.num_tokens) for r in plan.rows] == [("a", 0, 6)]
