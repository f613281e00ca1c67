"""The engine emits deltas: each step's RequestOutput holds only what is new for a request (token
ids, released text, logprob entries, the finish reason once), and summed they are exactly the
sequence's final state, with async scheduling on and off."""

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.output_processor import OutputAccumulator
from jaxserve.model.ragged import is_placeholder

SETTINGS = dict(
    dtype="float32",
    page_size=8,
    max_model_len=160,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    enable_prompt_logprobs=True,
    warm_up=False,
)
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, stop=["e", " a"]),  # text held back, then cut
    SamplingParams(max_tokens=20, temperature=1.0, seed=3, n=2, logprobs=2),
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=1, logprobs=0),
    SamplingParams(max_tokens=30, temperature=0.8, seed=7, stop=["the"], include_stop_str_in_output=True),
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),  # aborted while it runs
]
PROMPTS = [
    "the cat sat on the mat",
    "a dog ran off to see",
    "then it was very happy and",
    "see the dog who was",
    "on a mat and then it ran",
]


@pytest.fixture(scope="module")
def llm():
    with LLM("checkpoints/small", **SETTINGS) as llm:
        yield llm


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_deltas_sum_to_each_sequences_final_state(llm, async_scheduling):
    engine = llm.engine
    llm.overlap.async_scheduling = async_scheduling
    requests = {}
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"r{i}", None, params, llm.tokenizer.encode(prompt))
        requests[f"r{i}"] = engine.requests[f"r{i}"]  # kept: the engine drops a request once it finishes
    deltas: dict[str, list] = {rid: [] for rid in requests}
    steps = 0
    while llm.overlap.has_unfinished_requests():
        for delta in llm.overlap.step():
            deltas[delta.request_id].append(delta)
        steps += 1
        if steps == 6 and "r4" in engine.requests:
            deltas["r4"].append(engine.abort_request("r4"))
    totals = OutputAccumulator()
    for rid, request in requests.items():
        assert deltas[rid] and deltas[rid][-1].finished and not any(d.finished for d in deltas[rid][:-1])
        with_prompt_logprobs = [d for d in deltas[rid] if d.prompt_logprobs is not None]
        if request.params.prompt_logprobs is not None:  # once, in the first delta, complete
            assert with_prompt_logprobs == deltas[rid][:1]
            assert with_prompt_logprobs[0].prompt_logprobs == request.seqs[0].prompt_logprobs
            assert all(e is not None for e in with_prompt_logprobs[0].prompt_logprobs[1:])
        else:
            assert not with_prompt_logprobs
        for d in deltas[rid]:
            for o in d.outputs:
                assert not any(is_placeholder(t) for t in o.token_ids)
                if not async_scheduling or request.params.n == 1:
                    assert len(o.token_ids) <= 1  # one step, one new token (never the whole output again)
        reasons = [o.finish_reason for d in deltas[rid] for o in d.outputs if o.finish_reason is not None]
        assert sorted(reasons) == sorted(s.finish_reason for s in request.seqs)  # once per sample
        total = [totals.add(d) for d in deltas[rid]][-1]
        assert [o.index for o in total.outputs] == [s.index for s in request.seqs]
        for o, seq in zip(total.outputs, request.seqs):
            assert o.token_ids == seq.output_token_ids and o.text == seq.text and o.finish_reason == seq.finish_reason
            if seq.params.logprobs is not None:
                assert o.logprobs == seq.logprobs and o.cumulative_logprob == seq.cumulative_logprob
            else:
                assert o.logprobs is None
    assert [o.finish_reason for o in totals.outputs["r4"].outputs] == ["abort"]
    assert not any(s in totals.outputs["r0"].outputs[0].text for s in PARAMS[0].stop)  # cut before a stop
    llm.overlap.async_scheduling = True


def test_generate_returns_the_sum_of_the_deltas(llm):
    """LLM.generate sums the deltas; the same requests stepped by hand sum to the same outputs."""
    params = PARAMS[:4]
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    engine, totals = llm.engine, OutputAccumulator()
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"again{i}", None, p, engine.tokenizer.encode(prompt))
    while llm.overlap.has_unfinished_requests():
        for delta in llm.overlap.step():
            totals.add(delta)
    for i, out in enumerate(outs):
        again = totals.outputs[f"again{i}"]
        assert [(o.token_ids, o.text, o.finish_reason) for o in again.outputs] == [
            (o.token_ids, o.text, o.finish_reason) for o in out.outputs
        ]


def test_a_step_fetches_logprobs_only_when_a_row_asks(llm):
    """Without a row asking for logprobs only the sampled tokens come back to the host."""
    import jax

    engine = llm.engine
    fetched = []
    for rid, params in [
        ("plain", SamplingParams(max_tokens=3, temperature=0)),
        ("lp", SamplingParams(max_tokens=3, temperature=0, logprobs=2)),
    ]:
        engine.add_request(rid, None, params, engine.tokenizer.encode("the cat sat"))
        llm.overlap.step()
        fetched.append(len(jax.tree.leaves(llm.overlap.in_flight[-1].pending._out)))
        while llm.overlap.has_unfinished_requests():
            llm.overlap.step()
    assert fetched == [1, 4]  # tokens; tokens, logprobs, top ids, top logprobs
