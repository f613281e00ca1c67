"""With speculation on, warm-up compiles every speculative bucket: a varied workload afterwards (plain and
speculative steps, draft catch-up, forks, penalties, greedy and sampled rows) compiles nothing."""

import numpy as np
import pytest
from spec_testlib import perturbed_copy

from jaxserve import LLM, SamplingParams
from jaxserve.engine.compile import CompileCounter

SETTINGS = dict(dtype="float32", page_size=8, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_no_compilation_after_warm_up_with_speculation(hf_model_dir, tmp_path, method):
    path, model = hf_model_dir("llama")
    if method == "draft":
        # A draft as big as the target: the adaptive policy finds it not worth its cost and decodes
        # plainly, probing with one draft every 16 steps (after a catch-up of the draft's cache).
        spec = dict(speculative_model=perturbed_copy(model, str(tmp_path / "draft"), scale=0.003))
    else:
        spec = dict(speculative_method="ngram")
    llm = LLM(path, **SETTINGS, **spec, num_speculative_tokens=3)
    decoder = llm.engine.spec
    assert set(decoder.step_shapes()) <= set(decoder._executables)
    before = CompileCounter.requests
    rng = np.random.RandomState(0)
    for batch in (1, 2, 2, 1):
        segment = rng.randint(0, 512, size=3).tolist()
        prompts = [(segment * 3)[: rng.randint(1, 9)] for _ in range(batch)]
        params = [SamplingParams(max_tokens=int(rng.randint(18, 24)), temperature=float(rng.choice([0, 0.8])),
                                 repetition_penalty=float(rng.choice([1.0, 1.2])), ignore_eos=True)
                  for _ in range(batch)]
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    llm.generate(prompt_token_ids=[[5, 6, 7, 5, 6]], sampling_params=SamplingParams(n=2, max_tokens=20, seed=1),
                 use_tqdm=False)
    assert CompileCounter.requests == before
    assert llm.runner.unplanned_compiles == 0 and decoder.unplanned_compiles == 0
    stats = llm.engine.stats()
    assert stats["spec_decode_num_steps"] > 0 and stats["compiles_after_warmup"] == 0
    if method == "draft":  # plain steps ran too, and the draft caught up before its probes
        assert stats["spec_decode_num_steps"] < decoder.decode_steps
