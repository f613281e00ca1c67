"""One token budget per step: a prompt arriving while streams decode rides along in their steps."""

import numpy as np
import pytest
from engine_testlib import StepRecorder

from jaxserve import LLM, SamplingParams

SETTINGS = dict(
    dtype="float32",
    page_size=8,
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    enable_prefix_caching=False,
    warm_up=False,
)
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    path, _ = hf_model_dir("llama")
    with LLM(path, **SETTINGS) as llm:
        yield llm


def test_long_prompt_rides_along_with_running_decodes(llm):
    rng = np.random.RandomState(5)
    short = [rng.randint(0, 512, size=n).tolist() for n in (5, 9, 3)]
    long_prompt = rng.randint(0, 512, size=150).tolist()  # 150 tokens, a 32-token budget: 5+ steps
    engine = llm.engine
    with StepRecorder(engine, llm.overlap) as rec:
        plans, step = rec.plans, rec.step
        for i, prompt in enumerate(short):
            engine.add_request(f"s{i}", None, SamplingParams(max_tokens=40, **GREEDY), prompt)
        while any(s.num_computed < len(s.prompt_token_ids) for r in engine.requests.values() for s in r.seqs):
            step()
        running = [engine.requests[f"s{i}"].seqs[0] for i in range(3)]
        engine.add_request("long", None, SamplingParams(max_tokens=8, **GREEDY), long_prompt)
        long_seq = engine.requests["long"].seqs[0]
        plans.clear()
        while long_seq.num_computed < len(long_prompt):
            by_seq, gained = rec.mixed_step(running)
            assert by_seq[id(long_seq)].num_tokens > 1 or long_seq.num_computed == len(long_prompt)
            assert sum(r.num_tokens for r in by_seq.values()) <= SETTINGS["max_num_batched_tokens"]
            assert gained == [1] * len(running)
        assert len(plans) >= 5  # the prompt took several chunks, each beside the decodes
        while llm.overlap.has_unfinished_requests():
            step()
        outputs = rec.token_ids()
    for request_id, prompt, max_tokens in [*((f"s{i}", p, 40) for i, p in enumerate(short)), ("long", long_prompt, 8)]:
        alone = llm.generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False
        )
        assert outputs[request_id] == alone[0].outputs[0].token_ids, request_id
    stats = engine.stats()
    assert stats["steps_by_kind"]["mixed"] >= 5
    for r in range(engine.num_replicas):
        assert engine.blocks.num_free_pages(r) == engine.blocks.num_usable_pages
