"""logprobs_mode (vLLM's; issue 53 part 4): "raw_logprobs" are of the model's distribution,
"processed_logprobs" of the one each row draws from (after bias, penalties, temperature, top-k/p)."""

import jax
import numpy as np

from jaxserve.model.sampler import SamplingTensors, sample
from jaxserve.sampling.row import RowSampling

sample_jit = jax.jit(sample, static_argnames=("want_logprobs", "logprobs_mode"))


def log_softmax(x):
    x = np.asarray(x, np.float64)
    finite = np.isfinite(x)
    m = x[finite].max()
    return np.where(finite, x - m - np.log(np.exp(np.where(finite, x - m, -np.inf)).sum()), -np.inf)


def test_processed_logprobs_are_of_the_distribution_each_row_draws_from():
    rng = np.random.default_rng(3)
    B, V = 6, 64
    logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    rows = [
        RowSampling(temperature=0.7, top_k=10, seed=1, step=0, logprobs=4),
        RowSampling(temperature=1.3, top_p=0.8, seed=2, step=0),
        RowSampling(temperature=0.5, min_p=0.05, seed=3, step=0),
        RowSampling(temperature=1.0, logit_bias={5: 4.0}, seed=4, step=0),
        RowSampling(temperature=0.0, repetition_penalty=1.5, prompt_ids=[1, 2], step=0),  # greedy
        RowSampling(temperature=0.9, seed=5, step=0),
    ]
    st = SamplingTensors.pack(rows, B, 16)
    raw = jax.tree.map(np.asarray, sample_jit(logits, st, want_logprobs=4))
    out = jax.tree.map(np.asarray, sample_jit(logits, st, want_logprobs=4, logprobs_mode="processed_logprobs"))
    assert (out.tokens == raw.tokens).all()  # the mode changes what is reported, never what is sampled
    np.testing.assert_allclose(raw.logprobs, [log_softmax(x)[t] for x, t in zip(logits, raw.tokens)], atol=1e-5)
    for i, row in enumerate(rows):
        x = logits[i].astype(np.float64)
        if row.logit_bias:
            for t, b in row.logit_bias.items():
                x[t] += b
        if row.repetition_penalty != 1:
            for t in row.prompt_ids:
                x[t] = x[t] / row.repetition_penalty if x[t] > 0 else x[t] * row.repetition_penalty
        if row.temperature > 0:
            x = x / row.temperature
            order = np.sort(x)[::-1]
            keep = np.ones(V, bool)
            if row.top_k:
                keep &= x >= order[row.top_k - 1]
            if row.top_p < 1:
                p = np.exp(order - order[0])
                p /= p.sum()
                cut = int(np.searchsorted(np.cumsum(p), row.top_p)) + 1
                keep &= x >= order[cut - 1]
            if row.min_p:
                keep &= x >= order[0] + np.log(row.min_p)
            x = np.where(keep, x, -np.inf)
        want = log_softmax(x)
        assert abs(out.logprobs[i] - want[out.tokens[i]]) < 1e-4, i
        assert np.isfinite(out.logprobs[i])
    scaled = logits[0] / 0.7  # row 0's top logprobs are of its processed distribution too (top-10 of it)
    processed = log_softmax(np.where(scaled >= np.sort(scaled)[::-1][9], scaled, -np.inf))
    np.testing.assert_allclose(out.top_logprobs[0], np.sort(processed)[::-1][:4], atol=1e-4)


def test_every_step_that_samples_reports_the_mode():
    """A request with prompt logprobs samples its first token in the scoring step: under
    processed_logprobs that token's logprob is of the processed distribution there too, as the same
    request's without prompt logprobs (sampled by the plain step) is."""
    from jaxserve import LLM, SamplingParams

    settings = dict(dtype="float32", page_size=8, max_model_len=64, max_num_seqs=4, warm_up=False)
    params = dict(max_tokens=3, temperature=0.6, top_k=5, seed=11, logprobs=0)
    prompt = list(range(5, 21))
    with LLM("checkpoints/small", logprobs_mode="processed_logprobs", enable_prompt_logprobs=True, **settings) as llm:
        # Apart: in one batch both would sample in the scoring step.
        (plain,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**params), use_tqdm=False)
        (scored,) = llm.generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(prompt_logprobs=1, **params), use_tqdm=False
        )
    a, b = plain.outputs[0], scored.outputs[0]
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(b.sampled_logprobs(), a.sampled_logprobs(), atol=1e-5)
