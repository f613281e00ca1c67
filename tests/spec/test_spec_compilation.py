"""With speculation on, warm-up compiles every speculative bucket: a varied workload afterwards (plain and
speculative steps, draft catch-up, forks, penalties, greedy and sampled rows) compiles nothing."""

import numpy as np
import pytest
from spec_testlib import perturbed_copy

from jaxserve import LLM, SamplingParams
from jaxserve.engine.buckets import executable_counts
from jaxserve.runner.compilation import CompileCounter

SETTINGS = dict(dtype="float32", page_size=8, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16)


class SpeculateEvery:
    """A policy proposing 3 tokens every `interval` decode steps, whatever speculation costs."""

    adaptive = False

    def __init__(self, interval: int):
        self.interval = interval

    def choose(self, state, step_count, costs):
        return 3 if step_count % self.interval == 0 else 0


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_no_compilation_after_warm_up_with_speculation(hf_model_dir, tmp_path, method):
    path, model = hf_model_dir("llama")
    if method == "draft":
        spec = dict(speculative_model=perturbed_copy(model, str(tmp_path / "draft"), scale=0.003))
    else:
        spec = dict(speculative_method="ngram")
    llm = LLM(path, **SETTINGS, **spec, num_speculative_tokens=3)
    decoder = llm.engine.spec
    # Not the adaptive policy: on a model this small the measured costs are mostly host time and vary
    # with the machine's load. The draft speculates every third decode step (plain steps leave it
    # behind, so speculative steps run its catch-up too); n-gram on every step, where it finds a match.
    decoder.policy = SpeculateEvery(3 if method == "draft" else 1)
    # One table: a speculative engine's ragged steps are its speculative steps, all compiled at warm-up.
    assert set(llm.runner.step_shapes()) <= set(llm.runner.table.executables)
    assert len(llm.runner.table.executables) == executable_counts(llm.config).steps
    before = CompileCounter.requests
    rng = np.random.RandomState(0)
    for batch in (1, 2, 2, 1):
        segment = rng.randint(0, 512, size=3).tolist()
        prompts = [(segment * 3)[: rng.randint(1, 9)] for _ in range(batch)]
        params = [
            SamplingParams(
                max_tokens=int(rng.randint(18, 24)),
                temperature=float(rng.choice([0, 0.8])),
                repetition_penalty=float(rng.choice([1.0, 1.2])),
                ignore_eos=True,
            )
            for _ in range(batch)
        ]
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    llm.generate(
        prompt_token_ids=[[5, 6, 7, 5, 6]], sampling_params=SamplingParams(n=2, max_tokens=20, seed=1), use_tqdm=False
    )
    assert CompileCounter.requests == before
    assert llm.runner.unplanned_compiles == 0
    stats = llm.engine.stats()
    assert stats["spec_decode_num_steps"] > 0 and stats["compiles_after_warmup"] == 0
    assert stats["spec_decode_num_steps"] < decoder.decode_steps  # plain steps ran too
