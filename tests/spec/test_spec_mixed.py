"""Speculative verifications are rows of the one ragged step: streams verifying drafts keep going while
a long prompt is prefilled beside them, within one token budget, in the same executables."""

import numpy as np
import pytest
from engine_testlib import StepRecorder
from spec_testlib import perturbed_copy

from jaxserve import LLM, SamplingParams

K = 3
SETTINGS = dict(
    dtype="float32",
    page_size=8,
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    enable_prefix_caching=False,
    warm_up=False,
    num_speculative_tokens=K,
    speculative_adaptive=False,
)
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["draft", "ngram"])
def llm(request, hf_model_dir, tmp_path_factory):
    path, model = hf_model_dir("llama")
    if request.param == "draft":
        spec = dict(speculative_model=perturbed_copy(model, str(tmp_path_factory.mktemp("draft")), scale=0.003))
    else:
        spec = dict(speculative_method="ngram")
    with LLM(path, **SETTINGS, **spec) as llm:
        yield llm


def test_verifications_ride_along_with_a_long_prompt(llm):
    rng = np.random.RandomState(7)
    short = [(rng.randint(0, 512, size=4).tolist() * 3)[:n] for n in (7, 10, 5)]
    long_prompt = rng.randint(0, 512, size=150).tolist()  # 150 tokens under a 32-token budget
    engine = llm.engine
    with StepRecorder(engine) as rec:
        plans, step = rec.plans, rec.step
        for i, prompt in enumerate(short):
            engine.add_request(f"s{i}", None, SamplingParams(max_tokens=120, **GREEDY), prompt)
        running = [engine.requests[f"s{i}"].seqs[0] for i in range(3)]
        while min(len(s.output_token_ids) for s in running) < 24:  # into the loops greedy decoding of
            step()  # this model falls into: n-gram hits
        engine.add_request("long", None, SamplingParams(max_tokens=8, **GREEDY), long_prompt)
        long_seq = engine.requests["long"].seqs[0]
        plans.clear()
        verified = 0
        while long_seq.num_computed < len(long_prompt):
            by_seq, gained = rec.mixed_step(running)
            assert sum(r.num_tokens + r.num_lookahead for r in by_seq.values()) <= SETTINGS["max_num_batched_tokens"]
            assert all(1 <= g <= 1 + by_seq[id(s)].num_lookahead for g, s in zip(gained, running))
            verified += sum(by_seq[id(s)].num_lookahead > 0 for s in running)
        # Drafts verified beside the prompt's chunks: the draft model proposes K for every stream in
        # every step; the n-gram lookup only where the stream's last tokens occurred before.
        assert len(plans) >= 5 and verified >= (len(running) * len(plans) if engine.spec.method == "draft" else 1)
        while engine.has_unfinished_requests():
            step()
        outputs = rec.token_ids()
    assert engine.spec.counters.accepted > 0
    for request_id, prompt, max_tokens in [*((f"s{i}", p, 120) for i, p in enumerate(short)), ("long", long_prompt, 8)]:
        alone = llm.generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False
        )
        assert outputs[request_id] == alone[0].outputs[0].token_ids, request_id
    assert engine.stats()["steps_by_kind"]["mixed"] >= 5
    for r in range(engine.num_replicas):
        assert engine.blocks.num_free_pages(r) == engine.blocks.num_usable_pages
