"""The verification rule on synthetic distributions: emitted tokens follow the target's processed
distribution exactly (draft distributions and n-gram point masses), a wrong verifier is caught, and
greedy rows accept exactly the argmax matches."""

import jax
import numpy as np
import pytest
from spec_testlib import SIGNIFICANCE, chi_square_pvalue, processed_probs

from jaxserve.sampling import RowSampling, SamplingTensors
from jaxserve.spec_decode.rejection import expand_per_position, verify

V, K, N = 6, 2, 20000
# Sampling parameters are arrays, so every setting reuses one compilation.
SETTINGS = [dict(temperature=0.8, top_k=4), dict(temperature=1.3), dict(temperature=1.0, top_p=0.7),
            dict(temperature=1.0, min_p=0.15)]

verify_jit = jax.jit(verify, static_argnames=("accept_all",))


def distributions():
    """Target logits per verify position (context-free, so each position's exact law is known) and
    a deliberately different draft."""
    rng = np.random.RandomState(0)
    return rng.normal(0, 1.5, size=(K + 1, V)), rng.normal(0, 1.5, size=(K, V))


def sampling(rows):
    return SamplingTensors.pack(rows, len(rows))


def run(setting: dict, point_mass: bool, accept_all: bool):
    st = sampling([RowSampling(**setting, seed=i, step=3) for i in range(N)])
    target, draft = distributions()
    p, q = processed_probs(target, **setting), processed_probs(draft, **setting)
    rng = np.random.RandomState(1)
    if point_mass:  # n-gram: any proposal rule independent of the verifier's randomness
        drafts = rng.randint(0, V, size=(N, K))
    else:  # draft model: d_j ~ q_j
        drafts = np.stack([rng.choice(V, size=N, p=q[j]) for j in range(K)], axis=1)
    logits = np.broadcast_to(target, (N, K + 1, V)).astype(np.float32)
    draft_probs = None if point_mass else np.broadcast_to(q, (N, K, V)).astype(np.float32)
    out = jax.device_get(verify_jit(logits, drafts.astype(np.int32), draft_probs, np.full(N, K, np.int32), st,
                                    accept_all=accept_all))
    return p, q, drafts, out


def position_pvalues(p, out):
    """Per verify position j: the p-value of the token emitted there (rows that reached it) against p_j."""
    n, tokens = out.num_accepted, out.tokens
    return [chi_square_pvalue(np.bincount(tokens[n >= j, j], minlength=V), p[j]) for j in range(K + 1)]


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft", "ngram"])
def test_emitted_tokens_follow_the_target(point_mass):
    for setting in SETTINGS:
        p, q, drafts, out = run(setting, point_mass, accept_all=False)
        pvalues = position_pvalues(p, out)
        assert min(pvalues) > SIGNIFICANCE, (setting, pvalues)
    # Acceptance of the first draft: sum_x min(p, q) for a draft distribution, sum_x g(x) p(x) for points.
        expected = np.minimum(p[0], q[0]).sum() if not point_mass else p[0].mean()
        assert abs((out.num_accepted >= 1).mean() - expected) < 0.02
        # Accepted tokens are the drafts; filtering keeps every emitted token in the target's support.
        n = out.num_accepted
        assert all((out.tokens[n > j, j] == drafts[n > j, j]).all() for j in range(K))
        assert all((p[j][out.tokens[n >= j, j]] > 0).all() for j in range(K + 1))


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft", "ngram"])
def test_a_verifier_accepting_every_draft_is_caught(point_mass):
    p, _, _, out = run(SETTINGS[0], point_mass, accept_all=True)
    assert (out.num_accepted == K).all()
    assert max(position_pvalues(p, out)[:K]) < 1e-6


def test_greedy_rows_accept_argmax_matches():
    target, _ = distributions()
    best = target.argmax(-1)
    other = (best + 1) % V
    drafts = np.array([best[:K], [other[0], best[1]], [best[0], other[1]], best[:K]], np.int32)
    num_draft = np.array([K, K, K, 1], np.int32)
    logits = np.broadcast_to(target, (4, K + 1, V)).astype(np.float32)
    # A sampled row in the batch must not change the greedy rows.
    st = sampling([RowSampling(seed=i) for i in range(4)] + [RowSampling(temperature=1.0, seed=9)])
    out = jax.device_get(verify_jit(np.concatenate([logits, logits[:1]]), np.concatenate([drafts, drafts[:1]]),
                                    None, np.append(num_draft, K), st))
    assert out.num_accepted[:4].tolist() == [K, 0, 1, 1]
    assert out.tokens[0].tolist() == best.tolist()  # both drafts, then the bonus argmax
    assert out.tokens[1, 0] == best[0] and out.tokens[2, :2].tolist() == best[:2].tolist()
    assert out.tokens[3, :2].tolist() == best[:2].tolist()  # the row's own limit: one draft, then the target


def test_penalty_history_grows_with_the_drafts():
    st = SamplingTensors.pack([RowSampling(repetition_penalty=1.5, prompt_ids=[5, 7], output_ids=[9])], 1,
                              history_len=6)
    ext = jax.device_get(expand_per_position(st, np.array([[1, 2]], np.int32)))
    assert ext.history.tolist() == [[5, 7, 9, -1, -1, -1], [5, 7, 9, 1, -1, -1], [5, 7, 9, 1, 2, -1]]
    assert ext.step.tolist() == [0, 1, 2] and ext.prompt_len.tolist() == [2, 2, 2]
