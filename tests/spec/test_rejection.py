"""The verification rule on synthetic distributions: emitted tokens follow the target's processed
distribution exactly (draft distributions and n-gram point masses), a wrong verifier is caught,
greedy rows accept exactly the argmax matches, and ragged groups (one logit per real position, as a
step lays them out) verify exactly as the same groups laid out W positions each."""

import jax
import numpy as np
import pytest
from spec_testlib import SIGNIFICANCE, chi_square_pvalue, processed_probs

from jaxserve.model.sampler import RowSampling, SamplingTensors, sample
from jaxserve.spec_decode.rejection import expand_positions, positions_of, verify

V, K, N = 6, 2, 20000
# Sampling parameters are arrays, so every setting reuses one compilation.
SETTINGS = [
    dict(temperature=0.8, top_k=4),
    dict(temperature=1.3),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.0, min_p=0.15),
]

verify_jit = jax.jit(verify, static_argnames=("accept_all",))


def dense_positions(groups: int, width: int) -> np.ndarray:
    """group_logits of groups laid out `width` logits each, one after another."""
    return np.arange(groups * width, dtype=np.int32).reshape(groups, width)


def verify_dense(logits, drafts, draft_probs, num_draft, st, **kw):
    """verify() on logits f32[G, W, V]: every group owns W positions."""
    G, W, V = logits.shape
    return verify_jit(logits.reshape(G * W, V), dense_positions(G, W), drafts, draft_probs, num_draft, st, **kw)


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
    out = jax.device_get(
        verify_dense(logits, drafts.astype(np.int32), draft_probs, np.full(N, K, np.int32), st, accept_all=accept_all)
    )
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
    out = jax.device_get(
        verify_dense(
            np.concatenate([logits, logits[:1]]),
            np.concatenate([drafts, drafts[:1]]),
            None,
            np.append(num_draft, K),
            st,
        )
    )
    assert out.num_accepted[:4].tolist() == [K, 0, 1, 1]
    assert out.tokens[0].tolist() == best.tolist()  # both drafts, then the bonus argmax
    assert out.tokens[1, 0] == best[0] and out.tokens[2, :2].tolist() == best[:2].tolist()
    assert out.tokens[3, :2].tolist() == best[:2].tolist()  # the row's own limit: one draft, then the target


def test_penalty_history_grows_with_the_drafts():
    st = SamplingTensors.pack(
        [RowSampling(repetition_penalty=1.5, prompt_ids=[5, 7], output_ids=[9])], 1, history_len=6
    )
    group, offset = positions_of(dense_positions(1, K + 1), K + 1)
    ext = jax.device_get(expand_positions(st, np.array([[1, 2]], np.int32), group, offset))
    assert ext.history.tolist() == [[5, 7, 9, -1, -1, -1], [5, 7, 9, 1, -1, -1], [5, 7, 9, 1, 2, -1]]
    assert ext.step.tolist() == [0, 1, 2] and ext.prompt_len.tolist() == [2, 2, 2]


def test_positions_of_inverts_ragged_groups():
    # Groups of widths 3, 1, 2 at positions 0..5, two padding groups (all 0), two unused positions.
    group_logits = np.array([[0, 1, 2], [3, 3, 3], [4, 5, 5], [0, 0, 0], [0, 0, 0]], np.int32)
    group, offset = jax.device_get(positions_of(group_logits, 8))
    assert group[:6].tolist() == [0, 0, 0, 1, 2, 2] and offset[:6].tolist() == [0, 1, 2, 0, 0, 1]


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft", "ngram"])
def test_ragged_groups_verify_as_dense_ones(point_mass):
    """A step's groups hold 1..W real positions each, packed one after another (padding positions
    and padding groups after them); verifying them must give what the same groups give laid out W
    positions each: tokens, acceptances and logprobs, greedy, sampled and penalised rows alike."""
    W = K + 1
    widths = [3, 1, 2, 3, 1, 2, 3, 2]
    G, padding_groups, L = len(widths), 2, sum(widths) + 3
    rng = np.random.RandomState(2)
    ragged = rng.normal(0, 1.5, size=(L, V)).astype(np.float32)
    starts = np.cumsum([0] + widths[:-1])
    group_logits = np.zeros((G + padding_groups, W), np.int32)
    for g, (c, w) in enumerate(zip(starts, widths)):
        group_logits[g] = c + np.minimum(np.arange(W), w - 1)
    dense = ragged[group_logits[:G]]  # f32[G, W, V]: the same logits, W positions a group
    best = dense.argmax(-1)
    drafts = np.where(rng.rand(G, K) < 0.6, best[:, :K], rng.randint(0, V, size=(G, K))).astype(np.int32)
    num_draft = np.array(widths, np.int32) - 1
    rows = [RowSampling(seed=g, step=g, logprobs=3, **(SETTINGS[g % 4] if g % 2 else {})) for g in range(G)]
    rows[3] = RowSampling(repetition_penalty=1.4, prompt_ids=[1, 2], output_ids=[3], seed=3, step=1)
    draft_probs = None if point_mass else rng.dirichlet(np.ones(V), size=(G + padding_groups, K)).astype(np.float32)
    pad = [RowSampling()] * padding_groups
    a = jax.device_get(
        verify_jit(
            ragged,
            group_logits,
            np.concatenate([drafts, np.zeros((2, K), np.int32)]),
            draft_probs,
            np.append(num_draft, [0, 0]),
            SamplingTensors.pack(rows + pad, G + padding_groups, history_len=8),
        )
    )
    b = jax.device_get(
        verify_dense(
            dense,
            drafts,
            None if point_mass else draft_probs[:G],
            num_draft,
            SamplingTensors.pack(rows, G, history_len=8),
        )
    )
    assert a.num_accepted[:G].tolist() == b.num_accepted.tolist()
    assert 0 < b.num_accepted.sum() < num_draft.sum()  # some drafts accepted, some rejected
    for g in range(G):
        emitted = slice(0, b.num_accepted[g] + 1)
        assert a.tokens[g, emitted].tolist() == b.tokens[g, emitted].tolist()
        np.testing.assert_allclose(a.logprobs[g, emitted], b.logprobs[g, emitted], rtol=1e-6)
        assert a.top_ids[g, emitted].tolist() == b.top_ids[g, emitted].tolist()


def test_a_group_without_drafts_samples_as_the_sampler_does():
    """Small speculative buckets run the verifier alone (no plain-sampling branch): a group with no
    drafts must draw the sampler's very token, logprob and top logprobs, greedy, sampled, biased
    and penalised rows alike."""
    G, W = 8, K + 1
    rng = np.random.RandomState(3)
    logits = rng.normal(0, 1.5, size=(G, V)).astype(np.float32)
    rows = [RowSampling(seed=g, step=5 + g, logprobs=3, **SETTINGS[g % 4]) for g in range(G)]
    rows[0] = RowSampling(seed=0, logprobs=3)
    rows[1] = RowSampling(
        repetition_penalty=1.3, presence_penalty=0.5, prompt_ids=[1], output_ids=[2, 2], seed=1, logprobs=3
    )
    rows[2] = RowSampling(temperature=1.0, logit_bias={4: 3.0}, seed=2, step=1, logprobs=3)
    st = SamplingTensors.pack(rows, G, history_len=8)
    plain = jax.device_get(jax.jit(sample, static_argnames="want_logprobs")(logits, st, want_logprobs=V))
    group_logits = np.repeat(np.arange(G, dtype=np.int32)[:, None], W, axis=1)
    out = jax.device_get(
        verify_jit(logits, group_logits, np.zeros((G, K), np.int32), None, np.zeros(G, np.int32), st, np.ones(G, bool))
    )
    assert out.num_accepted.tolist() == [0] * G
    assert out.tokens[:, 0].tolist() == plain.tokens.tolist()
    np.testing.assert_allclose(out.logprobs[:, 0], plain.logprobs, rtol=1e-6)
    assert out.top_ids[:, 0].tolist() == plain.top_ids.tolist()
