"""prompt_logprobs (what loglikelihood evaluations need): equal to Hugging Face's, across chunks,
prefix-cache hits, n > 1 and preemption; refused clearly when the engine was not started for it."""

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.errors import RequestError

# Chunks of at most 16 tokens: a 45-token prompt is scored across three prefill steps.
BASE = dict(dtype="float32", page_size=8, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, warm_up=False)
PROMPT = np.random.RandomState(7).randint(0, 512, size=45).tolist()


@pytest.fixture(scope="module")
def hf_logprobs(hf_model_dir):
    _, model = hf_model_dir("llama")
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()  # row p: distribution of token p + 1


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    path, _ = hf_model_dir("llama")
    return LLM(path, enable_prompt_logprobs=True, **BASE)


def check_against_hf(prompt_logprobs, ref, top):
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for p in range(1, len(PROMPT)):
        entry = prompt_logprobs[p]
        np.testing.assert_allclose(entry[PROMPT[p]], ref[p - 1, PROMPT[p]], atol=1e-4, err_msg=f"position {p}")
        expected_top = np.argsort(-ref[p - 1])[:top]
        assert set(expected_top) <= set(entry), f"position {p}: top-{top} ids differ"
        assert len(entry) in (top, top + 1)


def test_prompt_logprobs_match_hf_across_chunks(llm, hf_logprobs):
    out = llm.generate(
        prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    )[0]
    check_against_hf(out.prompt_logprobs, hf_logprobs, 3)
    plain = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_prompt_logprobs_with_a_cached_prefix_and_n_samples(llm, hf_logprobs):
    # The prompt's pages are in the prefix cache from the test above: scoring recomputes them anyway.
    before = llm.engine.counters["prefill_tokens_computed"]
    out = llm.generate(
        prompt_token_ids=[PROMPT],
        sampling_params=SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=1, prompt_logprobs=0),
    )[0]
    assert llm.engine.counters["prefill_tokens_computed"] - before >= len(PROMPT) - 1
    check_against_hf(out.prompt_logprobs, hf_logprobs, 0)
    assert len(out.outputs) == 2


def test_prompt_logprobs_survive_preemption(hf_model_dir, hf_logprobs):
    path, _ = hf_model_dir("llama")
    small = LLM(path, enable_prompt_logprobs=True, **{**BASE, "num_pages": 15})  # two prompts fit, not two outputs
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outs = small.generate(prompt_token_ids=[PROMPT] * 3, sampling_params=params)
    assert small.engine.scheduler.num_preemptions > 0
    for out in outs:
        check_against_hf(out.prompt_logprobs, hf_logprobs, 1)


def test_prompt_logprobs_need_the_engine_setting(hf_model_dir):
    path, _ = hf_model_dir("llama")
    llm = LLM(path, **BASE)
    with pytest.raises(RequestError, match="enable_prompt_logprobs"):
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(prompt_logprobs=1))
    with pytest.raises(RequestError, match="prompt_logprobs must be an integer"):
        SamplingParams(prompt_logprobs=21)
