"""Speculative decoding in the engine: greedy outputs identical to plain decoding (draft and n-gram,
under preemption, prefix caching and penalties, with steps that verify nothing overlapping the next
one), stop conditions inside an accepted run, seeded sampling independent of the batch, per-request
metrics, and the vocabulary check."""

import dataclasses

import numpy as np
import pytest
from spec_testlib import assert_overlapped, perturbed_copy, record_dispatches, toggle_drafting

from jaxserve import LLM, SamplingParams
from jaxserve.errors import ConfigError

# Small buckets keep compilation short: batches 1-4, 4 or 8 pages of 8 tokens, chunks of 16 or 32.
BASE = dict(dtype="float32", page_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False)
SMALL_POOL = dict(num_pages=12)  # 11 usable pages (88 tokens) for 4 sequences of up to 54: preemption
K = 3


def varied_requests(n=32, seed=0):
    """Greedy requests of varied length; a quarter share a prefix (prefix caching), a quarter repeat a
    segment (n-gram hits), a quarter use penalties (exact through verification)."""
    rng = np.random.RandomState(seed)
    shared = rng.randint(0, 512, size=17).tolist()
    prompts, params = [], []
    for i in range(n):
        kind = i % 4
        if kind == 1:
            prompt = shared + rng.randint(0, 512, size=int(rng.randint(1, 10))).tolist()
        elif kind == 2:
            segment = rng.randint(0, 512, size=int(rng.randint(2, 7))).tolist()
            prompt = segment * 3 + segment[: int(rng.randint(0, len(segment)))]
        else:
            prompt = rng.randint(0, 512, size=int(rng.randint(1, 30))).tolist()
        penalties = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2) if kind == 3 else {}
        params.append(SamplingParams(max_tokens=int(rng.randint(1, 25)), temperature=0, ignore_eos=True, **penalties))
        prompts.append(prompt)
    return prompts, params


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_pool_whole(llm):
    blocks = llm.blocks
    assert blocks.num_free_pages(0) == blocks.num_usable_pages
    blocks.check_invariants()


@pytest.fixture(scope="module")
def target(hf_model_dir):
    return hf_model_dir("llama")


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    return perturbed_copy(target[1], str(tmp_path_factory.mktemp("draft")), scale=0.003)


@pytest.fixture(scope="module")
def reference(target):
    """Plain greedy decoding of the workload (outputs do not depend on preemption: tests/engine)."""
    llm = LLM(target[0], **BASE)
    prompts, params = varied_requests()
    return llm, token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))


@pytest.fixture(scope="module")
def draft_llm(target, draft_dir):
    return LLM(
        target[0],
        **BASE,
        **SMALL_POOL,
        speculative_model=draft_dir,
        num_speculative_tokens=K,
        speculative_adaptive=False,
    )


def test_draft_speculation_is_greedy_exact_under_preemption(draft_llm, reference):
    prompts, params = varied_requests()
    outputs = draft_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == reference[1]
    engine = draft_llm.engine
    stats = engine.stats()
    assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_prefix_hit_tokens > 0
    # Both fully accepted runs (the draft then lags a token) and rejections happened.
    assert 0.2 < stats["spec_decode_acceptance_rate"] < 0.97, stats
    assert stats["spec_decode_mean_accepted_length"] > 1.5
    assert stats["spec_decode_num_accepted_tokens"] > 0
    metrics = [o.metrics for o in outputs]
    assert sum(m.spec_draft_tokens for m in metrics) == stats["spec_decode_num_draft_tokens"]
    assert sum(m.spec_accepted_tokens for m in metrics) == stats["spec_decode_num_accepted_tokens"]
    assert all(m.spec_acceptance_rate is not None for m in metrics)
    assert_pool_whole(draft_llm)


def test_draft_speculation_overlaps_steps_that_verify_nothing(draft_llm, reference, monkeypatch):
    """Drafting switched on and off every few steps: the steps that verify nothing run beside the one
    before them (their tokens taken on the device, the draft's too), the others one at a time; the
    greedy outputs stay those of plain decoding, async scheduling on or off, and no page is lost."""
    toggle_drafting(monkeypatch, draft_llm.engine)
    seen = record_dispatches(monkeypatch, draft_llm)
    prompts, params = varied_requests()
    outputs = draft_llm.generate(prompt_token_ids=prompts[:16], sampling_params=params[:16], use_tqdm=False)
    assert token_ids(outputs) == reference[1][:16]
    assert draft_llm.engine.scheduler.num_preemptions > 0
    assert_overlapped(seen)
    assert_pool_whole(draft_llm)
    seen.clear()
    monkeypatch.setattr(draft_llm.overlap, "async_scheduling", False)
    outputs = draft_llm.generate(prompt_token_ids=prompts[:4], sampling_params=params[:4], use_tqdm=False)
    assert token_ids(outputs) == reference[1][:4]
    assert seen and all(depth == 0 for depth, _ in seen)
    assert_pool_whole(draft_llm)


def test_ngram_speculation_is_greedy_exact_under_preemption(target, reference):
    llm = LLM(
        target[0],
        **BASE,
        **SMALL_POOL,
        speculative_method="ngram",
        num_speculative_tokens=K,
        speculative_adaptive=False,
    )
    prompts, params = varied_requests()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == reference[1]
    stats = llm.engine.stats()
    assert llm.engine.scheduler.num_preemptions > 0
    # Drafts were verified under preemption. (Whether a random model accepts any n-gram draft here is
    # luck: 2 of 35 with alternating prefill/decode steps, 0 of a similar number with the ragged step's
    # larger prefill steps; acceptance itself is tested where every draft must be accepted.)
    assert stats["spec_decode_num_draft_tokens"] > 0, stats
    assert_pool_whole(llm)


def test_ngram_speculation_with_prompt_logprobs(target, reference):
    """A step scoring prompt tokens (prompt_logprobs) runs the plain scoring variant beside the
    speculative steps: greedy outputs as without speculation, every prompt token scored."""
    llm = LLM(
        target[0],
        **BASE,
        speculative_method="ngram",
        num_speculative_tokens=K,
        speculative_adaptive=False,
        enable_prompt_logprobs=True,
    )
    prompts, params = varied_requests(8)
    params = [dataclasses.replace(p, prompt_logprobs=1) if i % 2 else p for i, p in enumerate(params)]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == reference[1][:8]
    for i, out in enumerate(outputs):
        if i % 2:
            assert len(out.prompt_logprobs) == len(prompts[i]) and out.prompt_logprobs[0] is None
    assert_pool_whole(llm)


def test_stop_conditions_cut_an_accepted_run(draft_llm, reference):
    """EOS-like stop tokens and max_tokens inside a run of accepted drafts end the output exactly there;
    logprobs match plain decoding."""
    base_llm, expected = reference
    prompts, _ = varied_requests()
    i = max(range(len(expected)), key=lambda j: len(expected[j]))
    full = expected[i]
    stop = full[5]
    cut = full[: full.index(stop) + 1]
    params = [
        SamplingParams(max_tokens=len(full), temperature=0, stop_token_ids=[stop]),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=3),
    ]
    spec = draft_llm.generate(prompt_token_ids=[prompts[i]] * 2, sampling_params=params, use_tqdm=False)
    assert spec[0].outputs[0].token_ids == cut and spec[0].outputs[0].finish_reason == "stop"
    assert spec[1].outputs[0].token_ids == full[:7] and spec[1].outputs[0].finish_reason == "length"
    plain = base_llm.generate(prompt_token_ids=[prompts[i]], sampling_params=params[1], use_tqdm=False)[0]
    for got, want in zip(spec[1].outputs[0].logprobs, plain.outputs[0].logprobs):
        assert got.keys() == want.keys()
        assert all(abs(got[t] - want[t]) < 1e-4 for t in want)
    assert_pool_whole(draft_llm)


def test_seeded_sampling_with_speculation_is_independent_of_the_batch(draft_llm):
    rng = np.random.RandomState(3)
    prompts = [rng.randint(0, 512, size=8).tolist() for _ in range(3)]  # all three fit the small pool
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=100 + i) for i in range(3)]
    together = token_ids(draft_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    alone = [
        token_ids(draft_llm.generate(prompt_token_ids=[p], sampling_params=s, use_tqdm=False))[0]
        for p, s in zip(prompts, params)
    ]
    assert together == alone


def test_draft_with_another_vocabulary_is_refused(target, hf_model_dir):
    other, _ = hf_model_dir("llama", vocab_size=256)
    with pytest.raises(ConfigError, match="vocabulary of 256 tokens"):
        LLM(target[0], **BASE, speculative_model=other, num_speculative_tokens=2)


def test_speculative_steps_make_only_explicit_transfers(draft_llm):
    import jax

    engine = draft_llm.engine
    # Compile every step first (a compilation inside the guard would write the compilation cache and
    # trip it): a speculative engine's steps are its ragged buckets.
    engine.runner.warm_up(progress=False)
    rng = np.random.RandomState(9)
    for i in range(3):
        engine.add_request(
            f"g{i}",
            prompt_token_ids=rng.randint(0, 512, size=6).tolist(),
            sampling_params=SamplingParams(max_tokens=30, temperature=0.5 * i, ignore_eos=True),
        )
    while any(s.num_pending > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    before = engine.spec.counters.steps
    with jax.transfer_guard("disallow"):
        for _ in range(4):
            engine.step()
    assert engine.spec.counters.steps > before
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_whole(draft_llm)


def test_first_runs_of_an_executable_are_not_step_time_samples(draft_llm):
    """The adaptive policy prices steps by their measured times; a step that ran some executable for
    the first time (~15 ms slower on a CPU) would price its kind out for good, so it is no sample."""
    spec, runner = draft_llm.engine.spec, draft_llm.runner

    def generate():
        draft_llm.generate(
            prompt_token_ids=[[1, 2, 3, 4, 5]],
            sampling_params=SamplingParams(max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )

    generate()
    generate()  # a prefix-cache hit the second time: other prefill shapes
    key = ("plain", 1)
    before = len(spec._wall.get(key, ()))
    spec._timing = key
    runner.first_runs += 1  # as run_step counts a bucket's first call
    spec.record_step_time(1.0)
    assert len(spec._wall.get(key, ())) == before
    spec._timing = key
    spec.record_step_time(0.005)
    assert len(spec._wall[key]) == before + 1 and 1.0 not in spec._wall[key]
    runs = runner.first_runs
    generate()
    assert runner.first_runs == runs  # the same buckets again: no first runs


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_ngram_speculation_over_quantized_weights_is_greedy_exact(target, quantization):
    """Quantized weights verify drafts as they decode: with int8 (groups of 32) or int4 weights, n-gram
    speculation gives the same greedy tokens as plain decoding of the same quantized model."""
    quantized = dict(BASE, quantization=quantization)
    prompts, params = varied_requests(12, seed=3)
    plain = token_ids(
        LLM(target[0], **quantized).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    )
    llm = LLM(target[0], **quantized, speculative_method="ngram", num_speculative_tokens=K, speculative_adaptive=False)
    assert token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)) == plain
    assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0
    assert_pool_whole(llm)


def test_a_batch_where_verifying_loses_drafts_only_at_probes(target, reference, caplog, monkeypatch):
    """The adaptive policy decides for the batch first: where a verify step costs four plain steps no
    acceptance pays, so rows of a batch draft only at the shared probe steps; the engine says so, counts
    the steps, and the outputs stay exact. The steps kept from drafting overlap the next one."""
    import logging

    from jaxserve.spec_decode.policy import probe_interval

    llm = LLM(target[0], **BASE, speculative_method="ngram", num_speculative_tokens=K)  # adaptive
    spec = llm.engine.spec
    losing, cheap = [1.0] + [4.0] * K, [1.0] + [1.0 + 0.1 * k for k in range(1, K + 1)]
    spec.costs = lambda batch: cheap if batch == 1 else losing
    seen, lookahead = [], spec.lookahead

    def recorded(seq, batch_size):
        k = lookahead(seq, batch_size)
        seen.append((batch_size, spec.decode_steps, k))
        return k

    llm.engine.scheduler.lookahead = recorded
    dispatched = record_dispatches(monkeypatch, llm)
    prompts, params = varied_requests()
    with caplog.at_level(logging.INFO, logger="jaxserve.spec_decode.decoder"):
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == reference[1]
    batched = [(step, k) for batch, step, k in seen if batch > 1]
    assert batched and all(k == 0 or step % probe_interval(losing) == 0 for step, k in batched)
    assert llm.engine.stats()["spec_decode_num_off_steps"] > 0
    assert "off but for probes" in caplog.text
    assert any(depth == 1 for depth, _ in dispatched)  # dispatched beside the step before it
    assert_pool_whole(llm)
