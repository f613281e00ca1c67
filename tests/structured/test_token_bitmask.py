"""apply_token_bitmask on jax against llguidance's numpy reference; unconstrained rows untouched; jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from jaxserve.structured import StructuredSpec, allocate_bitmask, bitmask_words, unpack_bitmask
from jaxserve.structured.apply import apply_token_bitmask
from jaxserve.structured.bitmask import set_only


def random_bitmask(rng, rows, vocab):
    return rng.integers(-(2**31), 2**31, size=(rows, bitmask_words(vocab)), dtype=np.int64).astype(np.int32)


@pytest.mark.parametrize("vocab", [32, 100, 8192, 49152])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_llguidance_reference(vocab, dtype):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    mask = random_bitmask(rng, 5, vocab)
    mask[1] = -1  # an all-allowed row
    set_only(mask[2], [0, vocab - 1])
    ref = logits.copy()
    apply_token_bitmask_inplace(ref, mask)
    got = jax.jit(apply_token_bitmask)(jnp.asarray(logits, dtype), jnp.asarray(mask))
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.isinf(np.asarray(got, np.float32)), np.isinf(ref))
    np.testing.assert_array_equal(np.isneginf(np.asarray(got, np.float32)), ~unpack_bitmask(mask, vocab))
    kept = ~np.isinf(ref)
    np.testing.assert_array_equal(
        np.asarray(got, np.float32)[kept], np.asarray(jnp.asarray(logits, dtype), np.float32)[kept]
    )
    assert np.flatnonzero(~np.isinf(np.asarray(got[2], np.float32))).tolist() == [0, vocab - 1]


def test_unconstrained_rows_are_untouched_bit_for_bit():
    vocab = 1000
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    logits[0, 3] = np.nan  # even NaNs pass through an unconstrained row
    mask = random_bitmask(rng, 4, vocab)  # stale garbage in rows that are not constrained
    constrained = np.array([False, True, False, True])
    got = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(mask), jnp.asarray(constrained)))
    for r in (0, 2):
        assert got[r].tobytes() == logits[r].tobytes()
    np.testing.assert_array_equal(np.isneginf(got[1]), ~unpack_bitmask(mask[1], vocab))
    ones = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(allocate_bitmask(4, vocab))))
    assert ones.tobytes() == logits.tobytes()  # all-ones mask: identity without the flag too


def test_leading_axes_and_greedy_under_a_grammar(compiler, sp_tokenizer):
    g = compiler.compile(StructuredSpec.choice(["yes", "no"]))
    row = g.matcher().allowed_bitmask()
    logits = jnp.zeros((2, 3, g.vocab_size)).at[..., sp_tokenizer.token_to_id("{")].set(10.0)
    masks = jnp.broadcast_to(jnp.asarray(row), (2, 3, row.shape[0]))
    best = jnp.argmax(apply_token_bitmask(logits, masks), -1)
    assert {sp_tokenizer.decode([int(t)]) for t in np.asarray(best).ravel()} <= {"y", "n", "yes", "no"}


def test_one_executable_for_every_mix_of_rows():
    f = jax.jit(lambda x, b, c: apply_token_bitmask(x, b, c))  # its own cache
    logits = jnp.zeros((8, 64))
    mask = jnp.asarray(allocate_bitmask(8, 64))
    for k in range(4):
        f(logits, mask, jnp.arange(8) < k)
    assert f._cache_size() == 1


def test_shape_checks():
    logits = jnp.zeros((2, 100))
    with pytest.raises(ValueError, match="bitmask has 3 words per row; logits of 100 ids need 4"):
        apply_token_bitmask(logits, jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="do not match logits rows"):
        apply_token_bitmask(logits, jnp.zeros((3, 4), jnp.int32))
    with pytest.raises(ValueError, match="must be int32"):
        apply_token_bitmask(logits, jnp.zeros((2, 4), jnp.uint32))
    with pytest.raises(ValueError, match="constrained has shape"):
        apply_token_bitmask(logits, jnp.zeros((2, 4), jnp.int32), jnp.ones((3,), bool))
