"""Distribution preservation end to end: with a deliberately different draft, the joint distribution of
the first three sampled tokens equals the target's exact one (Pearson chi-square, significance 1e-3,
fixed seeds), and the same test rejects a verifier that accepts every draft token."""

import numpy as np
import pytest
import torch
from spec_testlib import SIGNIFICANCE, chi_square_pvalue, perturbed_copy, processed_probs

from jaxserve import LLM, SamplingParams

V = 32  # a small vocabulary: the joint law of three tokens has V^3 cells, most of them excluded by top-k
PROMPT = [3, 17, 9]
SETTING = dict(temperature=1.0, top_k=4)
REQUESTS, N = 250, 16  # 4000 samples; each request samples 16 sequences that share the prompt's pages
# A budget of 32 rows x (1 + 2 drafts): verifications share the step's token budget.
ENGINE = dict(
    dtype="float32",
    page_size=8,
    max_model_len=16,
    max_num_seqs=32,
    max_num_batched_tokens=96,
    warm_up=False,
    speculative_adaptive=False,
)


def exact_joint(model) -> np.ndarray:
    """P(x1, x2, x3 | prompt) of the target's processed distribution, from the torch model."""
    pairs = np.stack(np.meshgrid(np.arange(V), np.arange(V), indexing="ij"), -1).reshape(-1, 2)
    seqs = np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], axis=1)
    with torch.no_grad():
        logits = model(torch.tensor(seqs)).logits.double().numpy()  # [V*V, 5, V]
    n = len(PROMPT)
    p1 = processed_probs(logits[0, n - 1], **SETTING)  # [V]
    p2 = processed_probs(logits[::V, n], **SETTING)  # [V(x1), V]
    p3 = processed_probs(logits[:, n + 1], **SETTING).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def sample_counts(llm, requests: int) -> np.ndarray:
    params = [SamplingParams(n=N, max_tokens=3, ignore_eos=True, seed=r, **SETTING) for r in range(requests)]
    outputs = llm.generate(prompt_token_ids=[PROMPT] * requests, sampling_params=params, use_tqdm=False)
    counts = np.zeros((V, V, V), np.int64)
    for out in outputs:
        for c in out.outputs:
            counts[tuple(c.token_ids)] += 1
    return counts


@pytest.fixture(scope="module")
def models(hf_model_dir, tmp_path_factory):
    """The target and a deliberately different draft: a noisy copy whose processed distribution is
    about 0.5 in total variation from the target's (an unrelated model would rarely be accepted, and
    the accept path would go untested)."""
    target_path, target = hf_model_dir("llama", vocab_size=V)
    draft_path = perturbed_copy(target, str(tmp_path_factory.mktemp("draft32")), scale=0.02)
    return target_path, target, draft_path


def test_sampled_tokens_follow_the_target_and_a_wrong_verifier_is_caught(models):
    target_path, target, draft_path = models
    llm = LLM(target_path, **ENGINE, speculative_model=draft_path, num_speculative_tokens=2)
    joint = exact_joint(target)
    counts = sample_counts(llm, REQUESTS)
    stats = llm.engine.stats()
    # The draft is different enough to be rejected often, and right often enough to be accepted.
    assert 0.2 < stats["spec_decode_acceptance_rate"] < 0.8, stats
    pvalue = chi_square_pvalue(counts, joint)
    assert pvalue > SIGNIFICANCE, pvalue

    runner = llm.runner
    runner.speculation.accept_all = True
    for shape in runner.step_shapes():  # recompile the speculative steps with the wrong verifier
        runner.table.executables.pop(shape, None)
    wrong = sample_counts(llm, REQUESTS // 4)
    assert chi_square_pvalue(wrong, joint) < 1e-6


def test_eagle3_sampling_follows_the_target(hf_model_dir, tmp_path):
    """EAGLE-3's drafts (a head over a draft vocabulary of 24 of the 32 ids: the others have
    probability 0 under it) leave the sampled joint distribution the target's."""
    import jax

    from jaxserve.config import ModelConfig
    from jaxserve.loading.eagle3_checkpoint import save_eagle3
    from jaxserve.model.eagle3 import Eagle3Config, init_params

    target_path, target = hf_model_dir("llama", vocab_size=V, num_hidden_layers=4)
    cfg = ModelConfig.from_dir(target_path)
    vocab = np.sort(np.random.RandomState(1).choice(V, 24, replace=False))
    head = Eagle3Config.for_target(cfg, len(vocab), (1, 2, 3))
    # A zero lm_head: q uniform over the draft vocabulary after top-k's ties (accepted often enough to
    # test the accept path; a random head's sharp q was accepted 2% of the time).
    params = init_params(head, jax.random.PRNGKey(2), np.float32, vocab)
    params = params.replace(lm_head=np.zeros_like(params.lm_head))
    save_eagle3(str(tmp_path / "head"), head, params, target_name=target_path, dtype="float32")
    spec = {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 2}
    llm = LLM(target_path, **ENGINE, speculative_config=spec)
    joint = exact_joint(target)
    counts = sample_counts(llm, REQUESTS)
    stats = llm.engine.stats()
    assert stats["spec_decode_acceptance_rate"] > 0.05, stats  # the accept path runs
    pvalue = chi_square_pvalue(counts, joint)
    assert pvalue > SIGNIFICANCE, pvalue
    llm.close()
