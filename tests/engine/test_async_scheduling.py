"""Async scheduling: step N+1 is dispatched before step N's samples reach the host, and nothing a
user sees changes (tokens, text, finish reasons, logprobs), nor is any page lost."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner.step_io import PendingSamples
from jaxserve.engine.output_processor import OutputAccumulator
from engine_testlib import random_traffic

SETTINGS = dict(
    dtype="float32", page_size=8, max_model_len=192, max_num_seqs=8, max_num_batched_tokens=32, warm_up=False
)


def workload(tokenizer, n=28, seed=0):
    """Prompts and params covering what the host decides from sampled ids: EOS, stop strings,
    max_tokens, min_tokens, seeds, n > 1, logprobs and the three penalties."""
    rng = np.random.RandomState(seed)
    words = "the cat sat on a mat and then it ran off to see the dog who was very happy".split()
    prompts, params = [], []
    for i in range(n):
        prompts.append(" ".join(rng.choice(words, size=int(rng.randint(2, 30)))))
        kind = i % 7
        p = dict(max_tokens=int(rng.randint(4, 40)), temperature=0.0)
        if kind == 1:
            p.update(temperature=0.9, top_p=0.9, seed=int(rng.randint(1000)))
        elif kind == 2:
            p.update(stop=["e", " a"], include_stop_str_in_output=bool(i % 2))
        elif kind == 3:
            p.update(n=2, temperature=1.0, seed=i, logprobs=3)
        elif kind == 4:
            p.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, temperature=0.7, seed=i)
        elif kind == 5:
            p.update(min_tokens=3, max_tokens=60)
        elif kind == 6:
            p.update(ignore_eos=True, logprobs=2)
        params.append(SamplingParams(**p))
    return prompts, params


def summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


def logprob_values(outputs):
    return [
        [None if c.logprobs is None else [sorted(e.items()) for e in c.logprobs] for c in o.outputs] for o in outputs
    ]


@pytest.fixture(scope="module")
def outputs_both_ways():
    """The workload with overlap on and off, each with pages to spare and with preemption."""
    results = {}
    for asynchronous in (True, False):
        for pages in (None, 20):
            with LLM("checkpoints/small", **SETTINGS, num_pages=pages, async_scheduling=asynchronous) as llm:
                prompts, params = workload(llm.tokenizer)
                outs = llm.generate(prompts, params)
                results[asynchronous, pages] = (outs, llm.engine.scheduler.num_preemptions)
                blocks = llm.blocks
                assert blocks.num_free_pages(0) == blocks.num_usable_pages
                blocks.check_invariants()
    return results


@pytest.mark.parametrize("pages", [None, 20])
def test_overlap_changes_no_output(outputs_both_ways, pages):
    on, off = outputs_both_ways[True, pages][0], outputs_both_ways[False, pages][0]
    assert summary(on) == summary(off)
    for a, b in zip(logprob_values(on), logprob_values(off)):
        for x, y in zip(a, b):
            if x is not None:
                for ex, ey in zip(x, y):
                    assert [t for t, _ in ex] == [t for t, _ in ey]
                    np.testing.assert_allclose([v for _, v in ex], [v for _, v in ey], rtol=1e-5, atol=1e-5)
    reasons = {c.finish_reason for o in on for c in o.outputs}
    assert reasons == {"stop", "length"}  # the workload ends both ways
    assert any(c.text.endswith(("e", " a")) for o in on for c in o.outputs)  # a kept stop string
    if pages:
        assert outputs_both_ways[True, pages][1] > 0  # the small pool preempted


def test_next_step_is_dispatched_before_the_last_is_fetched(monkeypatch):
    events = []
    real_result = PendingSamples.result

    def result(self):
        events.append("fetch")
        return real_result(self)

    monkeypatch.setattr(PendingSamples, "result", result)
    with LLM("checkpoints/small", **SETTINGS) as llm:
        engine = llm.engine
        execute = engine.runner.execute

        def recording_execute(update):
            events.append("dispatch")
            return execute(update)

        engine.runner.execute = recording_execute
        for i in range(3):
            engine.add_request(
                f"r{i}", None, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), list(range(5 + i, 20 + i))
            )
        outputs, totals = {}, OutputAccumulator()
        while llm.overlap.has_unfinished_requests():
            for out in llm.overlap.step():
                outputs[out.request_id] = totals.add(out)
                assert all(t >= 0 for c in out.outputs for t in c.token_ids)  # no placeholder leaks out
    # every fetch but the last follows the dispatch of the next step
    assert events[:2] == ["dispatch", "dispatch"]
    assert events.count("dispatch") == events.count("fetch")
    fetches = [i for i, e in enumerate(events) if e == "fetch"]
    assert all(events[i - 1] == "dispatch" for i in fetches[:-1])
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs.values())


def test_aborts_while_a_step_is_in_flight_lose_no_page():
    """Random adds, aborts (often of rows in the dispatched step) and steps; afterwards every page is
    back in the pool and no output ever showed a placeholder."""
    rng = np.random.RandomState(7)
    with LLM("checkpoints/small", **SETTINGS, num_pages=24) as llm:
        blocks = llm.blocks
        random_traffic(llm, rng, 120, after_each=blocks.check_invariants)
        assert blocks.num_free_pages(0) == blocks.num_usable_pages
        blocks.check_invariants()


def test_switching_async_scheduling_off_mid_run_loses_nothing():
    """A step left in flight when the setting is switched off is processed by the next step."""
    with LLM("checkpoints/small", **SETTINGS) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        engine.add_request("a", None, params, list(range(5, 25)))
        deltas = []
        for _ in range(3):
            deltas += llm.overlap.step()
        assert llm.overlap.in_flight
        llm.overlap.async_scheduling = False
        while llm.overlap.has_unfinished_requests():
            deltas += llm.overlap.step()
        assert not llm.overlap.in_flight
        assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
        totals = OutputAccumulator()
        final = [totals.add(d) for d in deltas][-1]
        assert len(final.outputs[0].token_ids) == 10
        llm.overlap.async_scheduling = True
        assert (
            llm.generate(prompt_token_ids=[list(range(5, 25))], sampling_params=params)[0].outputs[0].token_ids
            == final.outputs[0].token_ids
        )
