"""Verification of draft tokens on device: greedy matching, and the rejection-sampling rule under which
the accepted tokens follow exactly the target's distribution.

For draft token d_j, proposed from the draft's distribution q_j, with the target's distribution p_j
at the same position (both *processed*: logit_bias, penalties, temperature, top-k, top-p, min-p, exactly as
`jaxserve.sampling` draws a normal token):

  * accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), in order, stopping at the first rejection;
  * on a rejection at j, draw the token from the residual max(0, p_j - q_j), renormalised;
  * if every draft is accepted, draw one more token from the target (the bonus token).

Each emitted token then has exactly the target's conditional distribution (Leviathan et al. 2023,
Chen et al. 2023). N-gram proposals are a point mass (q_j = one-hot of d_j): accept with probability
p_j(d_j), and the residual is p_j without d_j. Greedy rows (temperature 0) accept while the draft
equals the target's argmax and then emit the target's argmax: the same tokens as plain greedy decoding.

Randomness is keyed by (request seed, output index, purpose), so a seeded request samples the same
whatever else shares its batch. The bonus token uses the very key and draw of normal sampling, so a
row with no drafts samples exactly what a plain decode step would.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxserve.sampling import MAX_LOGPROBS, SAMPLING_EPS, SamplingTensors, filter_logits, penalise, step_keys

# Purposes folded into a row's (seed, output index) key; the bonus draw uses the key itself.
DRAFT, ACCEPT, RESIDUAL = 1, 2, 3


def purpose_keys(seed: jax.Array, step: jax.Array, purpose: int) -> jax.Array:
    """Keys for one purpose at output index `step` of each row (seed u32[N], step i32[N])."""
    return jax.vmap(lambda k: jax.random.fold_in(k, purpose))(step_keys(seed, step))


@flax.struct.dataclass
class VerifyOutput:
    """Per row: the accepted drafts, then the target's own token at index num_accepted (then zeros)."""

    tokens: jax.Array  # i32[N, T]  T = K + 1
    num_accepted: jax.Array  # i32[N]  emitted tokens = num_accepted + 1
    logprobs: jax.Array  # f32[N, T]  raw log_softmax of the target at each emitted token
    top_ids: jax.Array  # i32[N, T, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[N, T, MAX_LOGPROBS]


def expand_per_position(st: SamplingTensors, drafts: jax.Array) -> SamplingTensors:
    """The sampling rows of every verify position j = 0..K: output index step + j, and (for penalties)
    the history extended by the drafts d_1..d_j that position j follows."""
    N, K = drafts.shape
    T = K + 1
    rep = lambda x: jnp.repeat(x, T, axis=0)  # noqa: E731  [N, ...] -> [N * T, ...]
    Lh = st.history.shape[-1]
    length = jnp.sum(st.history >= 0, axis=-1)  # i32[N]: prompt + output tokens held
    offset = jnp.arange(Lh, dtype=jnp.int32)[None, :] - length[:, None]  # i32[N, Lh]: index into drafts
    gathered = jnp.take_along_axis(drafts, jnp.clip(offset, 0, K - 1), axis=1)  # i32[N, Lh]
    j = jnp.arange(T, dtype=jnp.int32)[None, :, None]
    use = (offset[:, None, :] >= 0) & (offset[:, None, :] < j)  # bool[N, T, Lh]
    history = jnp.where(use, gathered[:, None, :], st.history[:, None, :]).reshape(N * T, Lh)
    step = (st.step[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]).reshape(N * T)
    return jax.tree.map(rep, st).replace(step=step, history=history)


def verify(
    logits: jax.Array,  # f32[N, T, V]  the target at the pending token and each draft (T = K + 1)
    drafts: jax.Array,  # i32[N, K]
    draft_probs: jax.Array | None,  # f32[N, K, V] processed draft distributions; None = point masses (ngram)
    num_draft: jax.Array,  # i32[N]  drafts to verify in each row (<= K; the rest is padding)
    st: SamplingTensors,  # [N] rows; step = output index of the first token decided here
    want_logprobs: jax.Array | None = None,  # bool[N]: rows that return logprobs (None: all)
    *,
    accept_all: bool = False,  # a deliberately wrong verifier (tests show the distribution test fails)
) -> VerifyOutput:
    N, T, V = logits.shape
    K = T - 1
    raw = logits.astype(jnp.float32)
    st_t = expand_per_position(st, drafts)
    processed = penalise(raw.reshape(N * T, V), st_t)  # f32[N * T, V]
    sampled = st.temperature >= SAMPLING_EPS  # bool[N]
    in_run = jnp.arange(K, dtype=jnp.int32)[None, :] < num_draft[:, None]  # bool[N, K]

    def leading(accepted):  # i32[N]: accepted drafts before the first rejection
        return jnp.sum(jnp.cumprod(accepted & in_run, axis=1), axis=1).astype(jnp.int32)

    greedy = jnp.argmax(processed, axis=-1).astype(jnp.int32).reshape(N, T)
    n_greedy = leading(jnp.ones_like(in_run) if accept_all else drafts == greedy[:, :K])
    final_greedy = jnp.take_along_axis(greedy, n_greedy[:, None], axis=1)[:, 0]

    def sampled_rows():
        filtered = filter_logits(processed, st_t, jnp.repeat(sampled, T)).reshape(N, T, V)
        p = jax.nn.softmax(filtered, axis=-1)  # f32[N, T, V]
        p_d = jnp.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]  # f32[N, K]
        if draft_probs is None:
            q_d = jnp.ones_like(p_d)
        else:
            q_d = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        steps = st.step[:, None] + jnp.arange(K, dtype=jnp.int32)[None, :]
        keys = purpose_keys(jnp.repeat(st.seed, K), steps.reshape(-1), ACCEPT)
        u = jax.vmap(jax.random.uniform)(keys).reshape(N, K)
        # u < p/q, written without dividing; min(1, .) is implicit since u < 1.
        n = leading(jnp.ones_like(in_run) if accept_all else u * q_d < p_d)
        at_n = lambda x: jnp.take_along_axis(x, n[:, None, None], axis=1)[:, 0]  # noqa: E731  [N, V]
        p_n = at_n(p)
        last = jnp.minimum(n, K - 1)[:, None]
        if draft_probs is None:
            q_n = jax.nn.one_hot(jnp.take_along_axis(drafts, last, axis=1)[:, 0], V, dtype=p.dtype)
        else:
            q_n = jnp.take_along_axis(draft_probs, last[:, :, None], axis=1)[:, 0]
        residual = jnp.maximum(p_n - q_n, 0.0)
        # A rejection implies p(d) < q(d), so the residual has mass; guard rounding all the same.
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
        from_residual = jax.vmap(jax.random.categorical)(
            purpose_keys(st.seed, st.step + n, RESIDUAL), jnp.log(residual))
        bonus = jax.vmap(jax.random.categorical)(step_keys(st.seed, st.step + n), at_n(filtered))
        return n, jnp.where(n < num_draft, from_residual, bonus).astype(jnp.int32)

    n_sampled, final_sampled = jax.lax.cond(
        jnp.any(sampled), sampled_rows, lambda: (jnp.zeros(N, jnp.int32), jnp.zeros(N, jnp.int32)))
    n = jnp.where(sampled, n_sampled, n_greedy)
    final = jnp.where(sampled, final_sampled, final_greedy)

    j = jnp.arange(T, dtype=jnp.int32)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((N, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j < n[:, None], padded, jnp.where(j == n[:, None], final[:, None], 0))
    top = min(MAX_LOGPROBS, V)

    def logprobs():
        lse = jax.nn.logsumexp(raw, axis=-1)  # f32[N, T]
        chosen = jnp.take_along_axis(raw, tokens[..., None], axis=-1)[..., 0] - lse
        top_vals, top_ids = jax.lax.top_k(raw, top)
        return chosen, top_ids.astype(jnp.int32), top_vals - lse[..., None]

    def none():
        return jnp.zeros((N, T), jnp.float32), jnp.zeros((N, T, top), jnp.int32), jnp.zeros((N, T, top), jnp.float32)

    # Skipped unless a row asks: a top-k over [rows, T, V] cost ~5 ms per step on the CPU at batch 8.
    chosen, top_ids, top_logprobs = logprobs() if want_logprobs is None else jax.lax.cond(
        jnp.any(want_logprobs), logprobs, none)
    return VerifyOutput(tokens=tokens, num_accepted=n, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs)
