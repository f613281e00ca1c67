"""num_scheduler_steps: several decode steps per host round-trip give exactly the tokens, logprobs and
finish reasons of single steps, under page pressure too, and compile nothing after warm-up."""

import jax
import numpy as np
import pytest
from engine_testlib import StepRecorder

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError

BASE = dict(dtype="float32", page_size=8, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, warm_up=False)
STEPS = 4


def workload(n, seed):
    """Varied prompts and lengths; greedy, seeded sampling with every penalty, logprobs, stop ids."""
    rng = np.random.RandomState(seed)
    prompts = [rng.randint(0, 512, size=int(rng.randint(1, 40))).tolist() for _ in range(n)]
    params = []
    for i in range(n):
        kind = i % 4
        max_tokens = int(rng.randint(1, 30))
        if kind == 0:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        elif kind == 1:
            params.append(
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=0.9,
                    top_p=0.9,
                    seed=i,
                    repetition_penalty=1.3,
                    presence_penalty=0.5,
                    frequency_penalty=0.4,
                    ignore_eos=True,
                )
            )
        elif kind == 2:
            params.append(
                SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=20, seed=i, logprobs=3, ignore_eos=True)
            )
        else:  # stops at the first of a few common ids, after min_tokens
            params.append(
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=0.8,
                    seed=i,
                    min_tokens=2,
                    stop_token_ids=list(range(0, 512, 7)),
                    ignore_eos=True,
                )
            )
    return prompts, params


def summary(outputs):
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in outputs]


def assert_same(got, want):
    """Tokens and finish reasons exactly; logprobs to 1e-4 (the multi-step call fuses differently,
    which moves a logprob by an ulp or so; tokens sampled from the same logits must not move)."""
    assert [[c[:2] for c in o] for o in got] == [[c[:2] for c in o] for o in want]
    for o_got, o_want in zip(got, want):
        for (_, _, lp_got), (_, _, lp_want) in zip(o_got, o_want):
            assert (lp_got is None) == (lp_want is None)
            for e_got, e_want in zip(lp_got or [], lp_want or []):
                assert e_got.keys() == e_want.keys()
                assert np.allclose([e_got[t] for t in e_want], list(e_want.values()), atol=1e-4)


def assert_pool_whole(llm):
    blocks = llm.blocks
    for r in range(blocks.num_replicas):
        assert blocks.num_free_pages(r) == blocks.num_usable_pages
    blocks.check_invariants()


@pytest.fixture(scope="module")
def model_path(hf_model_dir):
    return hf_model_dir("llama")[0]


@pytest.fixture(scope="module")
def single_step_outputs(model_path):
    prompts, params = workload(32, seed=0)
    return summary(LLM(model_path, **BASE).generate(prompt_token_ids=prompts, sampling_params=params))


def test_multi_step_gives_the_outputs_of_single_steps(model_path, single_step_outputs):
    llm = LLM(model_path, **BASE, num_scheduler_steps=STEPS)
    prompts, params = workload(32, seed=0)
    steps_before = llm.engine.counters["steps"]
    outputs = summary(llm.generate(prompt_token_ids=prompts, sampling_params=params))
    assert_same(outputs, single_step_outputs)
    generated = sum(len(c[0]) for o in outputs for c in o)
    # Far fewer engine steps than tokens / batch: most decode calls ran several steps.
    assert llm.engine.counters["steps"] - steps_before < generated / 8 + 32
    assert_pool_whole(llm)


def test_multi_step_under_page_pressure(model_path, single_step_outputs):
    """A pool too small for everyone: lookahead pages are often missing (rows then take fewer steps)
    and sequences are preempted; the outputs still match."""
    llm = LLM(model_path, **{**BASE, "num_pages": 14}, num_scheduler_steps=STEPS)
    prompts, params = workload(32, seed=0)
    assert_same(summary(llm.generate(prompt_token_ids=prompts, sampling_params=params)), single_step_outputs)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_whole(llm)


def test_a_prompt_rides_along_with_multi_step_decodes(model_path):
    """No prefill step of its own for a prompt arriving while streams decode: every step until it is
    prefilled is one mixed step (each stream gains exactly one token), and multi-step calls resume
    after; outputs equal each request run alone."""
    greedy = dict(temperature=0, ignore_eos=True)
    rng = np.random.RandomState(7)
    short = [rng.randint(0, 512, size=n).tolist() for n in (4, 11, 6)]
    long_prompt = rng.randint(0, 512, size=100).tolist()  # 100 tokens, a 32-token budget: 4 steps
    with LLM(model_path, **{**BASE, "max_num_batched_tokens": 32}, num_scheduler_steps=STEPS) as llm:
        engine = llm.engine
        with StepRecorder(engine) as rec:
            for i, prompt in enumerate(short):
                engine.add_request(f"s{i}", None, SamplingParams(max_tokens=40, **greedy), prompt)
            while any(s.num_computed < len(s.prompt_token_ids) for r in engine.requests.values() for s in r.seqs):
                rec.step()
            running = [engine.requests[f"s{i}"].seqs[0] for i in range(3)]
            rec.step()
            assert rec.plans[-1].kind == "decode" and any(r.num_lookahead for r in rec.plans[-1].rows)
            engine.add_request("long", None, SamplingParams(max_tokens=8, **greedy), long_prompt)
            long_seq = engine.requests["long"].seqs[0]
            mixed = 0
            while long_seq.num_computed < len(long_prompt):
                by_seq, gained = rec.mixed_step(running)
                assert by_seq[id(long_seq)].num_tokens > 1 or long_seq.num_computed == len(long_prompt)
                assert gained == [1] * len(running) and not any(r.num_lookahead for r in by_seq.values())
                mixed += 1
            assert mixed >= 4
            rec.step()  # decodes alone again: one multi-step call, the long prompt's stream in it
            assert rec.plans[-1].kind == "decode" and sum(r.num_lookahead > 0 for r in rec.plans[-1].rows) == 4
            while engine.has_unfinished_requests():
                rec.step()
            outputs = rec.token_ids()
        assert "prefill" not in [p.kind for p in rec.plans[4:]]
        for request_id, prompt, max_tokens in [
            *((f"s{i}", p, 40) for i, p in enumerate(short)),
            ("long", long_prompt, 8),
        ]:
            alone = llm.generate(
                prompt_token_ids=[prompt],
                use_tqdm=False,
                sampling_params=SamplingParams(max_tokens=max_tokens, **greedy),
            )
            assert outputs[request_id] == alone[0].outputs[0].token_ids, request_id
        assert_pool_whole(llm)


def test_multi_step_compiles_nothing_after_warm_up_and_moves_only_the_samples(model_path):
    llm = LLM(
        model_path,
        dtype="float32",
        page_size=8,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_scheduler_steps=STEPS,
    )
    assert any(s[2:] == ("multi-step",) for s in llm.runner.step_shapes())  # the multi-step variants are warmed
    engine = llm.engine
    rng = np.random.RandomState(1)
    for i in range(4):
        engine.add_request(
            f"m{i}",
            prompt_token_ids=rng.randint(0, 512, size=int(rng.randint(1, 30))).tolist(),
            sampling_params=SamplingParams(max_tokens=25, temperature=0.7, seed=i),
        )
    while any(s.num_pending > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    with jax.transfer_guard("disallow"):
        for _ in range(3):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.runner.unplanned_compiles == 0
    assert_pool_whole(llm)


def test_multi_step_and_speculation_are_refused_together():
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        EngineConfig(model="x", num_scheduler_steps=2, num_speculative_tokens=3, speculative_method="ngram").validate()
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        EngineConfig(model="x", num_scheduler_steps=0).validate()
