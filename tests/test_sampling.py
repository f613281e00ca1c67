"""Sampler tests: filters never leak, greedy/seeding invariants, distributions, penalties and logprobs vs NumPy."""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.model.sampler import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    SAMPLING_EPS,
    RowSampling,
    SamplingTensors,
    apply_penalties,
    sample,
)
from jaxserve.sampling.params import SamplingParams

sample_jit = jax.jit(sample, static_argnames="want_logprobs")
penalties_jit = jax.jit(apply_penalties)
V = 128  # one vocabulary for most tests, so shapes (and compilations) repeat


def run(logits, rows, history_len=16, want_logprobs=0, batch=None):
    logits = np.asarray(logits, np.float32)
    st_ = SamplingTensors.pack(rows, batch if batch is not None else logits.shape[0], history_len)
    return jax.tree.map(np.asarray, sample_jit(logits, st_, want_logprobs=want_logprobs))


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ---- NumPy references ----------------------------------------------------------------------------
def ref_allowed(logits, temperature, top_k, top_p, min_p, slack=1e-5):
    """Tokens the filters may emit (float64; `slack` errs towards keeping boundary tokens)."""
    scaled = np.asarray(logits, np.float64) / temperature
    order = np.sort(scaled)[::-1]
    k = min(top_k, len(scaled)) if top_k > 0 else len(scaled)
    allowed = scaled >= order[k - 1]
    probs = np.exp(order[:k] - order[0])
    probs /= probs.sum()
    tail = np.cumsum(probs[::-1])[::-1]
    keep = (tail > 1 - top_p - slack) | (top_p >= 1)
    num_keep = max(int(keep.sum()), 1)
    allowed &= scaled >= order[num_keep - 1]
    if min_p > 0:
        allowed &= scaled >= order[0] + np.log(min_p) - slack
    return allowed


def ref_penalties(logits, prompt, output, rep, pres, freq):
    out = np.array(logits, np.float64)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= pres + freq * output.count(t)
    return out


def ref_distribution(logits, temperature, top_k, top_p, min_p):
    allowed = ref_allowed(logits, temperature, top_k, top_p, min_p, slack=0.0)
    scaled = np.where(allowed, np.asarray(logits, np.float64) / temperature, -np.inf)
    p = np.exp(scaled - scaled.max())
    return p / p.sum()


# ---- filtering -----------------------------------------------------------------------------------
row_params = st.fixed_dictionaries(
    {
        "temperature": st.floats(0.05, 3.0),
        "top_k": st.one_of(st.just(0), st.integers(1, V + 5)),
        "top_p": st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
        "min_p": st.one_of(st.just(0.0), st.floats(0.0, 0.95)),
    }
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    params=st.lists(row_params, min_size=4, max_size=4),
    seed=st.integers(0, 2**32 - 1),
    scale=st.floats(0.1, 20.0),
    quantum=st.sampled_from([0.0, 0.5]),
)
def test_filters_never_emit_a_disallowed_token(params, seed, scale, quantum):
    """Four parameter sets x 16 rows each (different steps = independent draws) in one batch."""
    rng = np.random.default_rng(seed % 2**32)
    base = rng.normal(size=(4, V)) * scale
    if quantum:  # coarse logits: many ties, also at the top-k / top-p boundary
        base = np.round(base / quantum) * quantum
    base = base.astype(np.float32)
    rows = [RowSampling(**params[r % 4], seed=seed, step=r) for r in range(64)]
    out = run(base[np.arange(64) % 4], rows)
    for r, token in enumerate(out.tokens):
        assert ref_allowed(base[r % 4], **params[r % 4])[token], (r, params[r % 4], token)


def test_one_compilation_serves_every_parameter_mix():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, V)).astype(np.float32)
    mixes = [
        [RowSampling()] * 64,
        [RowSampling(temperature=1.0, seed=i) for i in range(64)],
        [
            RowSampling(
                temperature=0.7,
                top_k=5,
                top_p=0.9,
                min_p=0.1,
                repetition_penalty=1.3,
                presence_penalty=0.5,
                frequency_penalty=0.2,
                prompt_ids=[1, 2],
                output_ids=[3],
            )
        ]
        * 64,
    ]
    run(logits, mixes[0])
    compiled = sample_jit._cache_size()
    for rows in mixes:
        run(logits, rows)
    assert sample_jit._cache_size() == compiled


# ---- greedy, temperature limit, seeding ----------------------------------------------------------
def test_greedy_is_argmax():
    logits = np.random.default_rng(1).normal(size=(64, V)).astype(np.float32)
    for t in (0.0, SAMPLING_EPS / 2):  # below the epsilon is greedy too (no overflowing 1/T)
        rows = [RowSampling(temperature=t, top_k=3, top_p=0.5, seed=i, step=i) for i in range(64)]
        np.testing.assert_array_equal(run(logits, rows).tokens, logits.argmax(-1))
    # top_k = 1 at any temperature is greedy as well.
    rows = [RowSampling(temperature=2.0, top_k=1, seed=i, step=i) for i in range(64)]
    np.testing.assert_array_equal(run(logits, rows).tokens, logits.argmax(-1))


def test_temperature_to_zero_approaches_argmax():
    rng = np.random.default_rng(2)
    logits = np.stack([rng.permutation(V) * 0.1 for _ in range(4)]).astype(np.float32)  # gaps >= 0.1
    hits = []
    for t in (1.0, 0.1, 1e-3):
        rows = [RowSampling(temperature=t, seed=9, step=s) for s in range(64)]
        hits.append(np.mean(run(logits[np.arange(64) % 4], rows).tokens == logits.argmax(-1)[np.arange(64) % 4]))
    assert hits[0] < hits[1] < hits[2] == 1.0, hits


def test_same_seed_and_step_give_the_same_token_in_any_batch():
    rng = np.random.default_rng(3)
    target_logits = rng.normal(size=V).astype(np.float32) * 2

    def other_rows(n):
        return [
            RowSampling(
                temperature=float(rng.choice([0.0, 1.3])),
                top_k=int(rng.choice([0, 7])),
                top_p=float(rng.choice([1.0, 0.6])),
                min_p=float(rng.choice([0.0, 0.2])),
                repetition_penalty=float(rng.choice([1.0, 1.5])),
                seed=int(rng.integers(2**32)),
                step=int(rng.integers(100)),
                prompt_ids=[1, 2, 3],
                output_ids=[4],
            )
            for _ in range(n)
        ]

    for target_params in (dict(temperature=0.9), dict(temperature=1.1, top_k=9, top_p=0.8, min_p=0.02)):
        seen = []
        for step in range(12):
            target = RowSampling(**target_params, seed=1234, step=step)
            tokens = []
            for batch, position in ((16, 11), (16, 0), (64, 40), (64, 3)):
                rows = other_rows(batch)
                rows[position] = target
                logits = rng.normal(size=(batch, V)).astype(np.float32)
                logits[position] = target_logits
                tokens.append(run(logits, rows).tokens[position])
            assert len(set(tokens)) == 1, (target_params, step, tokens)
            seen.append(tokens[0])
        assert len(set(seen)) > 1  # the stream does move with the step
    # A different seed is a different stream.
    a = run(np.tile(target_logits, (64, 1)), [RowSampling(temperature=1.0, seed=1, step=s) for s in range(64)])
    b = run(np.tile(target_logits, (64, 1)), [RowSampling(temperature=1.0, seed=2, step=s) for s in range(64)])
    assert (a.tokens != b.tokens).any()


# ---- distributions -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        dict(temperature=0.5, top_k=5, top_p=1.0, min_p=0.0),
        dict(temperature=1.5, top_k=0, top_p=0.8, min_p=0.05),
        dict(temperature=1.0, top_k=6, top_p=0.7, min_p=0.0),  # top-p over the renormalised top-k mass
    ],
)
def test_empirical_distribution_matches_softmax(params):
    n, vocab = 64 * 64, 16
    # The other V - 16 entries are masked (-inf), as padded vocabularies are: they must never come out.
    logits = np.full(V, -np.inf, np.float32)
    logits[:vocab] = np.random.default_rng(4).normal(size=vocab)
    tokens = np.concatenate(
        [
            run(np.tile(logits, (64, 1)), [RowSampling(**params, seed=77, step=s) for s in range(i, i + 64)]).tokens
            for i in range(0, n, 64)
        ]
    )
    expected = ref_distribution(logits, **params)
    counts = np.bincount(tokens, minlength=V)
    assert counts[expected == 0].sum() == 0
    support = expected > 0
    chi2 = ((counts[support] - n * expected[support]) ** 2 / (n * expected[support])).sum()
    df = support.sum() - 1
    assert chi2 < df + 6 * np.sqrt(2 * df) + 1, (chi2, df)  # ~p < 1e-4 for these df; seeds are fixed


# ---- penalties -----------------------------------------------------------------------------------
def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(5)
    B, Lh = 64, 16
    logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    logits[:, V - 1] = 5.0  # -1 padding must not touch the last token
    rows = []
    for b in range(B):
        prompt = rng.integers(0, V - 1, size=int(rng.integers(0, 8))).tolist()
        output = rng.integers(0, 12, size=int(rng.integers(0, 9))).tolist()  # small ids: repeats
        rows.append(
            RowSampling(
                repetition_penalty=float(rng.choice([1.0, 0.7, 1.8])),
                presence_penalty=float(rng.choice([0.0, 0.5, -1.0])),
                frequency_penalty=float(rng.choice([0.0, 0.3, -0.4])),
                prompt_ids=prompt,
                output_ids=output,
            )
        )
    rows[0] = dataclass_replace(rows[0], repetition_penalty=1.5, presence_penalty=0.25, frequency_penalty=0.5)
    st_ = SamplingTensors.pack(rows, B, Lh)
    got = np.asarray(penalties_jit(logits, st_))
    for b, r in enumerate(rows):
        want = ref_penalties(
            logits[b],
            list(r.prompt_ids),
            list(r.output_ids),
            r.repetition_penalty,
            r.presence_penalty,
            r.frequency_penalty,
        )
        np.testing.assert_allclose(got[b], want, rtol=1e-6, atol=1e-6, err_msg=f"row {b}: {r}")
    # Greedy decoding sees the penalised logits; logprobs stay those of the raw model output.
    out = run(logits, rows, history_len=Lh, want_logprobs=MAX_LOGPROBS)
    np.testing.assert_array_equal(out.tokens, got.argmax(-1))
    np.testing.assert_allclose(out.logprobs, log_softmax(logits)[np.arange(B), out.tokens], atol=1e-5)


def test_penalty_semantics_by_hand():
    logits = np.zeros((1, V), np.float32)
    logits[0, :4] = [2.0, -2.0, 2.0, 2.0]
    # token 0 in the prompt only; 1 in the prompt; 2 twice in the output; 3 never seen.
    row = RowSampling(
        repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, prompt_ids=[0, 1], output_ids=[2, 2]
    )
    got = np.asarray(penalties_jit(np.tile(logits, (64, 1)), SamplingTensors.pack([row], 64, 16)))[0, :4]
    np.testing.assert_allclose(got, [1.0, -4.0, 1.0 - 0.5 - 0.5, 2.0])


def dataclass_replace(row, **changes):
    import dataclasses

    return dataclasses.replace(row, **changes)


# ---- logprobs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, MAX_LOGPROBS])
def test_logprobs_of_chosen_and_top_n(n):
    rng = np.random.default_rng(6)
    logits = (rng.normal(size=(64, V)) * 4).astype(np.float32)
    rows = [
        RowSampling(
            temperature=float(t),
            top_k=10,
            seed=3,
            step=i,
            repetition_penalty=1.2,
            prompt_ids=[5],
            logprobs=n if i == 5 else 0,
        )  # one row asking computes the top-N of every row
        for i, t in enumerate(np.linspace(0, 2, 64))
    ]
    out = run(logits, rows, want_logprobs=n)
    ref = log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(64), out.tokens], atol=1e-5)
    assert out.top_ids.shape == out.top_logprobs.shape == (64, n)
    assert out.top_ids.dtype == np.int32
    np.testing.assert_allclose(out.top_logprobs, -np.sort(-ref, axis=-1)[:, :n], atol=1e-5)
    np.testing.assert_allclose(np.take_along_axis(ref, out.top_ids, -1), out.top_logprobs, atol=1e-5)
    assert (np.diff(out.top_logprobs, axis=-1) <= 0).all()


def test_top_logprobs_are_skipped_when_no_row_asks():
    rng = np.random.default_rng(7)
    logits = (rng.normal(size=(8, V)) * 4).astype(np.float32)
    out = run(logits, [RowSampling(seed=i) for i in range(8)], want_logprobs=MAX_LOGPROBS)
    assert out.top_ids.shape == (8, MAX_LOGPROBS) and not out.top_logprobs.any()  # zeros: nobody reads them
    np.testing.assert_allclose(out.logprobs, log_softmax(logits)[np.arange(8), out.tokens], atol=1e-5)


# ---- packing -------------------------------------------------------------------------------------
def test_pack_layout_padding_and_batch_shapes():
    rows = [
        RowSampling(
            temperature=0.5, top_k=-1, seed=2**32 - 1, step=3, frequency_penalty=0.1, prompt_ids=[7, 8], output_ids=[9]
        ),
        None,
        RowSampling(prompt_ids=[1] * 50),
    ]
    st_ = SamplingTensors.pack(rows, (2, 3), history_len=4)
    assert st_.temperature.shape == (2, 3) and st_.history.shape == (2, 3, 4)
    assert st_.top_k[0, 0] == 0 and st_.seed[0, 0] == 2**32 - 1 and st_.seed.dtype == np.uint32
    np.testing.assert_array_equal(st_.history[0, 0], [7, 8, 9, -1])
    assert st_.prompt_len[0, 0] == 2
    assert (st_.history[0, 2] == -1).all()  # unpenalised rows ship no history, whatever its length
    assert (st_.temperature.reshape(-1)[1:] == 0).all() and (st_.repetition_penalty.reshape(-1)[1:] == 1).all()
    with pytest.raises(ValueError, match="history_len"):
        SamplingTensors.pack([RowSampling(repetition_penalty=1.1, prompt_ids=[1] * 5)], 1, history_len=4)
    with pytest.raises(ValueError, match="do not fit"):
        SamplingTensors.pack([None] * 3, 2)
    spec = SamplingTensors.spec((2, 3), 4)
    assert jax.tree.map(lambda s: (s.shape, s.dtype), spec) == jax.tree.map(lambda a: (a.shape, a.dtype), st_)


def test_leading_batch_dims_equal_flat_batch():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(4, 16, V)).astype(np.float32)
    rows = [
        RowSampling(temperature=1.0, top_p=0.9, seed=i, step=i, presence_penalty=0.3, output_ids=[1]) for i in range(64)
    ]
    nested = jax.tree.map(
        np.asarray, sample_jit(logits, SamplingTensors.pack(rows, (4, 16), 16), want_logprobs=MAX_LOGPROBS)
    )
    flat = run(logits.reshape(64, V), rows, want_logprobs=MAX_LOGPROBS)
    assert nested.tokens.shape == (4, 16) and nested.top_ids.shape == (4, 16, MAX_LOGPROBS)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.reshape(b.shape), b), nested, flat)


def test_from_sampling_params():
    params = SamplingParams(temperature=0.3, top_k=-1, top_p=0.5, seed=11)
    row = RowSampling.from_params(params, seed=11, step=4, prompt_ids=[1], output_ids=[2])
    assert (row.temperature, row.top_k, row.top_p, row.seed, row.step) == (0.3, 0, 0.5, 11, 4)
    assert (row.min_p, row.repetition_penalty, row.presence_penalty, row.frequency_penalty) == (0.0, 1.0, 0.0, 0.0)
    assert not row.uses_penalties


# ---- logit_bias ----------------------------------------------------------------------------------
def test_logit_bias_moves_greedy_and_leaves_other_rows_alone():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, V)).astype(np.float32)
    top = int(np.argmax(logits[1]))
    rows = [RowSampling(logit_bias={7: 100.0}), RowSampling(logit_bias={top: -100.0}), RowSampling()]
    out = run(logits, rows, want_logprobs=2)
    assert out.tokens[0] == 7
    assert out.tokens[1] == int(np.argsort(logits[1])[-2])  # the runner-up once the top token is pushed down
    solo = run(logits[2:], [RowSampling()], want_logprobs=2)
    assert out.tokens[2] == solo.tokens[0] and out.logprobs[2] == solo.logprobs[0]
    # Logprobs stay those of the raw model distribution (vLLM's raw_logprobs), bias or not.
    np.testing.assert_allclose(out.logprobs[0], log_softmax(logits[0])[7], atol=1e-5)
    # Sampled rows see the bias too: +100 leaves the other tokens ~e^-90 of the mass.
    sampled = run(logits, [RowSampling(temperature=1.0, seed=s, logit_bias={7: 100.0}) for s in range(3)])
    assert (sampled.tokens == 7).all()


def test_logit_bias_pack_layout():
    st_ = SamplingTensors.pack([None, RowSampling(logit_bias={3: 1.5, 9: -2.0})], 2)
    assert st_.bias_ids.shape == (2, MAX_LOGIT_BIAS) and st_.bias_values.dtype == np.float32
    assert (st_.bias_ids[0] == -1).all() and (st_.bias_values[0] == 0).all()
    np.testing.assert_array_equal(st_.bias_ids[1, :3], [3, 9, -1])
    np.testing.assert_array_equal(st_.bias_values[1, :3], [1.5, -2.0, 0.0])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingTensors.pack([RowSampling(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})], 1)
    row = RowSampling.from_params(SamplingParams(logit_bias={"4": 2}), seed=0, step=0)
    assert row.logit_bias == {4: 2.0}


@pytest.mark.parametrize(
    "bias,needle",
    [
        ({1: 100.5}, r"\[-100, 100\]"),
        ({1: float("nan")}, r"\[-100, 100\]"),
        ({"a": 1}, "token ids"),
        ({-1: 1}, "negative"),
        ({i: 0 for i in range(301)}, "at most 300"),
        ([1, 2], "map"),
    ],
)
def test_logit_bias_validation(bias, needle):
    from jaxserve.errors import RequestError

    with pytest.raises(RequestError, match=needle):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={}).logit_bias is None
