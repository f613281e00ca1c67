"""The continuous-batching engine: batch invariance, preemption, prefix caching, aborts, host traffic."""

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.errors import RequestError
from jaxserve.runner import input_transfer

BASE = dict(dtype="float32", page_size=8, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, warm_up=False)


def make_requests(n, seed=0, max_prompt=40, max_out=24):
    rng = np.random.RandomState(seed)
    prompts = [rng.randint(0, 512, size=int(rng.randint(1, max_prompt))).tolist() for _ in range(n)]
    params = [SamplingParams(max_tokens=int(rng.randint(1, max_out)), temperature=0, ignore_eos=True) for _ in range(n)]
    return prompts, params


def tokens_of(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_pool_whole(llm):
    blocks = llm.blocks
    for r in range(blocks.num_replicas):
        assert blocks.num_free_pages(r) == blocks.num_usable_pages  # free + evictable cached
    blocks.check_invariants()


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    path, _ = hf_model_dir("llama")
    return LLM(path, **BASE)


@pytest.fixture(scope="module")
def solo_outputs(llm):
    """Each request of the 64-request workload run alone."""
    prompts, params = make_requests(64)
    return [
        llm.generate(prompt_token_ids=[p], sampling_params=s)[0].outputs[0].token_ids for p, s in zip(prompts, params)
    ]


def test_batch_invariance_64_requests(llm, solo_outputs):
    prompts, params = make_requests(64)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert tokens_of(outputs) == solo_outputs
    assert all(len(t) == p.max_tokens for t, p in zip(tokens_of(outputs), params))
    assert_pool_whole(llm)


def test_preemption_recomputes_to_the_same_output(hf_model_dir, solo_outputs):
    path, _ = hf_model_dir("llama")
    small = LLM(path, **{**BASE, "num_pages": 14})  # 13 usable pages of 8 tokens for 64 requests
    prompts, params = make_requests(64)
    outputs = small.generate(prompt_token_ids=prompts, sampling_params=params)
    assert small.engine.scheduler.num_preemptions > 0
    assert tokens_of(outputs) == solo_outputs
    assert_pool_whole(small)


def test_reserve_mode_never_preempts(hf_model_dir, solo_outputs):
    path, _ = hf_model_dir("llama")
    reserve = LLM(path, **{**BASE, "num_pages": 14, "preemption_mode": "reserve"})
    prompts, params = make_requests(64)
    outputs = reserve.generate(prompt_token_ids=prompts, sampling_params=params)
    assert reserve.engine.scheduler.num_preemptions == 0
    assert tokens_of(outputs) == solo_outputs


def test_static_batching_gives_the_same_outputs(hf_model_dir, solo_outputs):
    path, _ = hf_model_dir("llama")
    static = LLM(path, **{**BASE, "scheduling": "static"})
    prompts, params = make_requests(64)
    assert tokens_of(static.generate(prompt_token_ids=prompts, sampling_params=params)) == solo_outputs


def test_prefix_caching_recomputes_only_the_suffix(hf_model_dir):
    path, _ = hf_model_dir("llama", max_position_embeddings=1024)
    settings = {**BASE, "max_model_len": 640, "page_size": 16}
    rng = np.random.RandomState(5)
    prefix = rng.randint(0, 512, size=512).tolist()
    first, second = prefix + [1, 2, 3], prefix + [4, 5, 6, 7, 8]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cached = LLM(path, **settings)
    cached.generate(prompt_token_ids=[first], sampling_params=greedy)
    before = cached.engine.counters["prefill_tokens_computed"]
    out = cached.generate(prompt_token_ids=[second], sampling_params=greedy)[0].outputs[0].token_ids
    assert cached.engine.counters["prefill_tokens_computed"] - before == len(second) - 512
    uncached = LLM(path, **settings, enable_prefix_caching=False)
    assert uncached.generate(prompt_token_ids=[second], sampling_params=greedy)[0].outputs[0].token_ids == out


def test_aborts_mid_prefill_and_mid_decode_free_every_page(llm):
    engine = llm.engine
    rng = np.random.RandomState(7)
    for i in range(6):
        engine.add_request(
            f"a{i}",
            prompt_token_ids=rng.randint(0, 512, size=100).tolist(),
            sampling_params=SamplingParams(max_tokens=20, temperature=0.7, seed=i),
        )
    llm.overlap.step()  # a prefill step: some prompts are partly computed
    partial = [s for s in engine.scheduler.running if 0 < s.num_computed < s.num_tokens - 1]
    assert partial, "expected a request mid-prefill"
    engine.abort_request(partial[0].request_id)
    for _ in range(12):
        llm.overlap.step()
    decoding = [s for s in engine.scheduler.running if s.output_token_ids]
    assert decoding, "expected requests mid-decode"
    out = engine.abort_request(decoding[0].request_id)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    while llm.overlap.has_unfinished_requests():
        llm.overlap.step()
    assert_pool_whole(llm)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    prompts, _ = make_requests(6, seed=3)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=100 + i) for i in range(6)]
    together = tokens_of(llm.generate(prompt_token_ids=prompts, sampling_params=params))
    alone = [
        llm.generate(prompt_token_ids=[p], sampling_params=s)[0].outputs[0].token_ids for p, s in zip(prompts, params)
    ]
    assert together == alone
    shuffled = tokens_of(llm.generate(prompt_token_ids=prompts[::-1], sampling_params=params[::-1]))
    assert shuffled == together[::-1]


def test_n_samples_share_the_prompt_pages(llm):
    prompt = list(range(1, 30))
    out = llm.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=11)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # different random streams
    first = llm.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=12, temperature=1.0, seed=11)
    )[0]
    assert first.outputs[0].token_ids == out.outputs[0].token_ids  # sample 0 is the n=1 stream
    assert_pool_whole(llm)


def test_n_samples_fork_under_page_pressure(hf_model_dir):
    """Forking n samples needs a page each; when the pool is short, other sequences are preempted (and
    recomputed later) instead of the fork failing. Same tokens as with pages to spare."""
    path, _ = hf_model_dir("llama")
    rng = np.random.RandomState(3)
    prompts = [rng.randint(0, 512, size=40).tolist() for _ in range(2)]  # 5 pages each, growing to 9
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 2
    wide = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=5)
    prompt = list(range(1, 22))  # 3 pages, the last part-filled: every sample needs a page of its own

    def run(llm):
        outs = llm.generate(prompt_token_ids=[prompt] + prompts, sampling_params=[wide] + params)
        return tokens_of(outs[1:]), [c.token_ids for c in outs[0].outputs]

    roomy = LLM(path, **BASE)
    small = LLM(path, **{**BASE, "num_pages": 14})  # 13 usable: all taken by the three prompts
    assert run(small) == run(roomy)
    assert small.engine.scheduler.num_preemptions > 0
    assert_pool_whole(small)
    with pytest.raises(RequestError, match="n=8 samples"):
        small.engine.add_request("too-wide", prompt_token_ids=list(range(1, 60)), sampling_params=SamplingParams(n=8))


def test_request_that_can_never_fit_is_rejected_at_add(llm):
    with pytest.raises(RequestError, match="maximum context length"):
        llm.engine.add_request("big", prompt_token_ids=[1] * 200)
    with pytest.raises(RequestError, match="n=9 exceeds max_num_seqs"):
        llm.engine.add_request("wide", prompt_token_ids=[1], sampling_params=SamplingParams(n=9))
    with pytest.raises(RequestError, match="already in use"):
        llm.engine.add_request("dup", prompt_token_ids=[1])
        llm.engine.add_request("dup", prompt_token_ids=[1])
    llm.engine.abort_request("dup")


def test_decode_loop_makes_one_explicit_transfer_each_way_per_step(llm, monkeypatch):
    engine = llm.engine
    prompts, params = make_requests(4, seed=9)
    for i, (p, s) in enumerate(zip(prompts, params)):
        engine.add_request(f"t{i}", prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=30, temperature=0))
    while any(s.num_pending > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        llm.overlap.step()  # prefill (and compile) outside the guard
    llm.overlap.step()
    calls = {"device_put": 0, "device_get": 0}
    for name in calls:

        def counted(*args, _real=getattr(jax, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(jax, name, counted)
    operands = count_step_operands(engine.runner, monkeypatch)
    with jax.transfer_guard("disallow"):
        for _ in range(5):
            llm.overlap.step()
    # The packed inputs in (a NumPy operand each step, which the executable's call copies: the
    # guard would refuse any other transfer), the samples out.
    assert calls == {"device_put": 0, "device_get": 5}
    assert operands == [np.ndarray] * 5
    monkeypatch.undo()
    while llm.overlap.has_unfinished_requests():
        llm.overlap.step()


def test_copies_of_the_packed_inputs_are_kept_and_reused(llm, monkeypatch):
    """Each plain step's call reads a copy of its bucket's buffer (the writer rewrites the buffer for
    the next step); the copies are kept and rewritten once their step is done (`InputTransfer.stage`),
    not allocated every step, and each call reads the words the writer wrote for it."""
    engine, runner = llm.engine, llm.runner
    prompts, _ = make_requests(3, seed=12)
    for i, p in enumerate(prompts):
        engine.add_request(f"k{i}", prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=25, temperature=0))
    seen, real, real_pack, written = [], runner.plain.call, runner.plain.pack, {}

    def call_step(executable, state, sparse, buffer):
        if "words" in written:  # a step of a bucket's input batch
            seen.append((buffer, buffer.copy(), written.pop("words")))
        return real(executable, state, sparse, buffer)

    def pack_written(*args):
        packed = real_pack(*args)
        written["words"] = packed.buffer.copy()
        return packed

    monkeypatch.setattr(runner.plain, "call", call_step)
    monkeypatch.setattr(runner.plain, "pack", pack_written)
    while llm.overlap.has_unfinished_requests():
        llm.overlap.step()
    monkeypatch.undo()
    assert len(seen) > 20
    for _, read, words in seen:
        np.testing.assert_array_equal(read, words)
    staged = runner.transfer._staged
    kept = [entry[0] for entries in staged.values() for entry in entries]
    assert all(any(buffer is copy for copy in kept) for buffer, _, _ in seen)  # every call read a kept copy
    assert all(len(entries) <= input_transfer._MAX_STAGED for entries in staged.values())


def count_step_operands(runner, monkeypatch) -> list:
    """The type of the packed-inputs operand of each plain step's call, from now on."""
    operands, real = [], runner.plain.call

    def call_step(executable, state, sparse, buffer):
        operands.append(type(buffer))
        return real(executable, state, sparse, buffer)

    monkeypatch.setattr(runner.plain, "call", call_step)
    return operands


def test_sparse_sampling_inputs_are_copied_only_when_a_row_uses_them(llm, monkeypatch):
    """The penalty histories and logit-bias slots travel apart from the packed buffer: with a
    penalised row in the batch each step copies them too (a second transfer); the steps of the test
    above, where no row uses them, reuse the idle arrays on the device."""
    engine = llm.engine
    prompts, _ = make_requests(2, seed=11)
    engine.add_request(
        "plain", prompt_token_ids=prompts[0], sampling_params=SamplingParams(max_tokens=30, temperature=0)
    )
    engine.add_request(
        "penalised",
        prompt_token_ids=prompts[1],
        sampling_params=SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3),
    )
    while any(s.num_pending > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        llm.overlap.step()
    llm.overlap.step()
    calls = {"device_put": 0}
    real = jax.device_put

    def counted(*args, **kwargs):
        calls["device_put"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(jax, "device_put", counted)
    operands = count_step_operands(engine.runner, monkeypatch)
    with jax.transfer_guard("disallow"):
        for _ in range(5):
            llm.overlap.step()
    assert calls == {"device_put": 5}  # the sparse inputs, each step
    assert operands == [np.ndarray] * 5  # and the packed ones, copied by the call
    monkeypatch.undo()
    while llm.overlap.has_unfinished_requests():
        llm.overlap.step()


def test_engine_settings_reject_unknown_modes():
    with pytest.raises(Exception, match="not one of"):
        EngineConfig(model="x", scheduling="sometimes")


def test_add_request_with_text_needs_a_tokenizer(llm):
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.engine.add_request("text", "hello")


def test_forks_after_warm_up_compile_nothing(hf_model_dir):
    from jaxserve.runner.compilation import CompileCounter

    path, _ = hf_model_dir("llama")
    llm = LLM(path, **{**BASE, "max_model_len": 32, "max_num_seqs": 2, "max_num_batched_tokens": 16, "warm_up": True})
    before = CompileCounter.requests
    out = llm.generate(
        prompt_token_ids=[list(range(1, 12))],
        sampling_params=SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1),
    )[0]
    assert len(out.outputs) == 2 and out.metrics.first_token_time >= out.metrics.arrival_time
    assert CompileCounter.requests == before
    assert llm.engine.stats()["last_step_bytes_read"] > llm.memory.param_bytes


def test_step_composition_counts_every_step(llm):
    """/metrics' steps_total{kind} and iteration_tokens: every step counted once, every computed token once;
    prompts arriving together share steps with the first ones' decodes ("mixed")."""
    before = llm.engine.stats()
    prompts, params = make_requests(6, seed=3)
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    after = llm.engine.stats()
    assert sum(after["steps_by_kind"].values()) == llm.engine.counters["steps"]
    computed = after["iteration_tokens"]["sum"] - before["iteration_tokens"]["sum"]
    prefilled = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]  # prefix-cache hits excluded
    generated = sum(p.max_tokens for p in params)
    assert 0 < prefilled <= sum(map(len, prompts))
    assert computed == prefilled + generated - len(prompts)  # each token but the last is a decode step's input
    assert after["steps_by_kind"]["mixed"] > before["steps_by_kind"]["mixed"]
    assert after["steps_by_kind"]["decode"] > before["steps_by_kind"]["decode"]
