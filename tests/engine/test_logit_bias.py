"""logit_bias through the engine: it moves greedy tokens at every step (plain, multi-step and speculative
decoding), leaves the other rows of its batch exactly as they run alone, and compiles nothing new."""

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.errors import RequestError

BASE = dict(dtype="float32", page_size=8, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, warm_up=False)
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 12, 12, 64, 8], list(range(20, 50))]
FORCED = 123


def greedy(max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def tokens(llm, prompts, params):
    return [
        o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    ]


@pytest.fixture(scope="module")
def path(hf_model_dir):
    return hf_model_dir("llama")[0]


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, **BASE)


@pytest.fixture(scope="module")
def solo(llm):
    """Each prompt alone, greedy and unbiased."""
    return [tokens(llm, [p], greedy())[0] for p in PROMPTS]


def check_bias(llm, solo):
    # +100 on one token: greedy emits it at every step.
    assert tokens(llm, PROMPTS[:1], greedy(logit_bias={FORCED: 100}))[0] == [FORCED] * 12
    # -100 on the greedy token of every step: it never appears, and the first token changes.
    banned = sorted(set(solo[0]))
    out = tokens(llm, PROMPTS[:1], greedy(logit_bias={t: -100 for t in banned}))[0]
    assert out[0] != solo[0][0] and not set(out) & set(banned)
    # One biased row beside two unbiased ones: those equal their solo runs token for token.
    mixed = tokens(llm, PROMPTS, [greedy(logit_bias={FORCED: 100}), greedy(), greedy()])
    assert mixed[0] == [FORCED] * 12 and mixed[1:] == solo[1:]


def test_logit_bias_moves_greedy_and_spares_the_other_rows(llm, solo):
    assert FORCED not in solo[0]
    check_bias(llm, solo)


def test_sampled_rows_see_the_bias(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=4, ignore_eos=True, logit_bias={FORCED: 100})
    assert tokens(llm, PROMPTS[1:2], params)[0] == [FORCED] * 8


def test_multi_step_decode_sees_the_bias(path, solo):
    with LLM(path, **BASE, num_scheduler_steps=4) as multi:
        check_bias(multi, solo)


def test_ngram_speculation_sees_the_bias(path, solo):
    with LLM(path, **BASE, speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False) as spec:
        check_bias(spec, solo)
        # The forced run repeats one token, so n-gram lookup drafts it, and the verifier (which sees
        # the biased target) accepts those drafts.
        out = spec.generate(
            prompt_token_ids=PROMPTS[:1], sampling_params=greedy(logit_bias={FORCED: 100}), use_tqdm=False
        )[0]
        assert out.outputs[0].token_ids == [FORCED] * 12
        assert out.metrics.spec_accepted_tokens > 0


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    vocab = llm.model_config.vocab_size
    with pytest.raises(RequestError, match="logit_bias token id"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=greedy(logit_bias={vocab: 1}))


def test_logit_bias_compiles_nothing_after_warm_up(path):
    from jaxserve.runner.compilation import CompileCounter

    with LLM(
        path, **{**BASE, "max_model_len": 32, "max_num_seqs": 2, "max_num_batched_tokens": 16, "warm_up": True}
    ) as warm:
        before = CompileCounter.requests
        out = tokens(
            warm,
            PROMPTS[:2],
            [
                greedy(6, logit_bias={FORCED: 100}),
                SamplingParams(
                    max_tokens=6, temperature=0.7, seed=1, ignore_eos=True, logit_bias={i: -100.0 for i in range(300)}
                ),
            ],
        )
        assert out[0] == [FORCED] * 6 and not set(out[1]) & set(range(300))  # 300 entries: the full width
        assert CompileCounter.requests == before and warm.runner.unplanned_compiles == 0


def test_draft_model_speculation_sees_the_bias(path, solo):
    """The target as its own draft: with the bias in the draft's proposals too, every greedy draft is
    accepted (a draft that ignored a +100 bias would have each one rejected)."""
    with LLM(path, **BASE, speculative_model=path, num_speculative_tokens=3, speculative_adaptive=False) as spec:
        check_bias(spec, solo)
        out = spec.generate(
            prompt_token_ids=PROMPTS[:1], sampling_params=greedy(logit_bias={FORCED: 100}), use_tqdm=False
        )[0]
        assert out.outputs[0].token_ids == [FORCED] * 12
        assert out.metrics.spec_draft_tokens > 0
        assert out.metrics.spec_accepted_tokens == out.metrics.spec_draft_tokens
