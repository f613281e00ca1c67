"""The scheduler's output says what changed, and the runner's running batch, applying it, holds what
the sequences hold: each step's rows read out of the batch's slots equal the sequences' tokens, page
tables, sampling and output index, under async scheduling, preemption, forks and aborts."""

from array import array

import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence
from jaxserve.model.ragged import placeholder
from jaxserve.runner.running_batch import RunningBatch
from engine_testlib import random_traffic

SETTINGS = dict(
    dtype="float32", page_size=8, max_model_len=192, max_num_seqs=8, max_num_batched_tokens=32, warm_up=False
)


def _seq(name: str, prompt: list[int], **params) -> Sequence:
    return Sequence(name, name, 0, prompt, SamplingParams(**params), seed=1)


def test_a_decode_sends_its_new_token_and_a_placeholder_again_once_resolved():
    blocks = BlockManager(64, 4, 1)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    batch = RunningBatch()
    seq = _seq("a", list(range(1, 7)), max_tokens=8)
    scheduler.add(seq)

    first = scheduler.schedule().update
    assert [n.slot for n in first.new_rows] == [0] and first.new_rows[0].token_ids == list(range(1, 7))
    (row,) = batch.apply(first)
    assert row.tokens == list(range(1, 7)) and row.samples and row.step == 0
    seq.num_computed = 6
    seq.output_token_ids.append(placeholder(0))  # the step's sample, in flight

    second = scheduler.schedule().update
    assert not second.new_rows
    (u,) = second.rows
    assert (u.tokens_from, u.tokens) == (6, [placeholder(0)])
    (row,) = batch.apply(second)
    assert row.tokens == [placeholder(0)] and row.start_pos == 6 and row.step == 1
    seq.num_computed = 7
    seq.output_token_ids[0] = 42  # the first step's sample reached the host
    seq.output_token_ids.append(placeholder(3))

    third = scheduler.schedule().update
    (u,) = third.rows
    assert (u.tokens_from, u.tokens) == (6, [42, placeholder(3)])  # the resolved id, then the new token
    (row,) = batch.apply(third)
    assert row.tokens == [placeholder(3)] and row.step == 2
    assert row.sampling.output_ids == [42, placeholder(3)]  # what penalties read: the sequence's own


def test_pages_added_go_as_a_diff_and_freed_slots_are_reused():
    blocks = BlockManager(64, 4, 1)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a, b = _seq("a", [1, 2, 3, 4], max_tokens=8), _seq("b", [5, 6], max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    update = scheduler.schedule().update
    assert [n.slot for n in update.new_rows] == [0, 1]
    assert list(update.new_rows[0].page_ids) == list(blocks.live_page_ids("a")[0])
    a.num_computed, b.num_computed = 4, 2
    a.output_token_ids.append(9)
    b.output_token_ids.append(9)
    update = scheduler.schedule().update  # a's fifth token needs a second page: only that page is sent
    ua = next(u for u in update.rows if u.slot == 0)
    assert ua.pages_from == 1 and list(ua.page_ids) == list(blocks.live_page_ids("a")[0][1:])
    ub = next(u for u in update.rows if u.slot == 1)
    assert ub.page_ids is None  # b still fits its page

    scheduler.finish(a, "stop")
    c = _seq("c", [7, 8, 9], max_tokens=4)
    scheduler.add(c)
    b.num_computed = 3
    b.output_token_ids.append(9)
    update = scheduler.schedule().update
    assert update.finished == [0]
    assert [(n.slot, n.token_ids) for n in update.new_rows] == [(0, [7, 8, 9])]  # a's slot, reused


def test_the_running_batch_holds_what_the_sequences_hold():
    """A random run with async scheduling, few pages (preemptions), n = 2 forks, penalties and aborts:
    after every update is applied, each scheduled row's slot holds its sequence's tokens and page
    table, and each row the variant lays out has the sequence's tokens, sampling and output index."""
    rng = np.random.RandomState(3)
    checked = {"rows": 0, "new": 0, "finished": 0}
    with LLM("checkpoints/small", **SETTINGS, num_pages=20) as llm:
        engine, runner, blocks = llm.engine, llm.engine.runner, llm.blocks
        execute_batch, execute_update = engine.execute, runner.execute
        current = []

        def core_execute(batch):
            current[:] = [batch]
            return execute_batch(batch)

        def runner_execute(update):
            pending = execute_update(update)
            batch = current[0]
            slots = runner.batch._slots
            for row, u in zip(batch.rows, update.rows, strict=True):
                seq, held = row.seq, slots[u.slot]
                assert held.prompt == seq.prompt_token_ids and held.output == seq.output_token_ids
                assert held.pages == array("i", blocks.live_page_ids(seq.seq_id)[0])
                assert held.sampling.output_ids is held.output
                checked["rows"] += 1
            assert len({u.slot for u in update.rows}) == len(update.rows)
            held = engine.scheduler.tracker._held  # the sequences the batch holds: each with pages, one slot
            assert sorted(slots) == sorted(h.slot for h in held.values()) and all(i in blocks for i in held)
            checked["new"] += len(update.new_rows)
            checked["finished"] += len(update.finished)
            return pending

        engine.execute, runner.execute = core_execute, runner_execute
        random_traffic(llm, rng, 100, penalties=True)
        assert llm.engine.scheduler.num_preemptions > 0
    assert checked["rows"] > 200 and checked["new"] > 20 and checked["finished"] > 10
