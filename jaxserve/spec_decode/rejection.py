"""Verification of draft tokens on device: greedy matching, and the rejection-sampling rule under which
the accepted tokens follow exactly the target's distribution.

For draft token d_j, proposed from the draft's distribution q_j, with the target's distribution p_j
at the same position (both *processed*: logit_bias, penalties, temperature, top-k, top-p, min-p, exactly as
`jaxserve.model.sampler` draws a normal token):

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

from jaxserve.model.sampler import MAX_LOGPROBS, SAMPLING_EPS, SamplingTensors, filter_logits, penalise, step_keys

# Purposes folded into a row's (seed, output index) key; the bonus draw uses the key itself.
DRAFT, ACCEPT, RESIDUAL = 1, 2, 3


def purpose_keys(seed: jax.Array, step: jax.Array, purpose: int) -> jax.Array:
    """Keys for one purpose at output index `step` of each row (seed u32[N], step i32[N])."""
    return jax.vmap(lambda k: jax.random.fold_in(k, purpose))(step_keys(seed, step))


@flax.struct.dataclass
class VerifyOutput:
    """Per group: the accepted drafts, then the target's own token at index num_accepted (then zeros)."""

    tokens: jax.Array  # i32[G, W]  W = K + 1
    num_accepted: jax.Array  # i32[G]  emitted tokens = num_accepted + 1
    logprobs: jax.Array  # f32[G, W]  raw log_softmax of the target at each emitted token
    top_ids: jax.Array  # i32[G, W, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[G, W, MAX_LOGPROBS]


def positions_of(group_logits: jax.Array, num_logits: int) -> tuple[jax.Array, jax.Array]:
    """(group i32[L], offset i32[L]) of each logit position, inverting `group_logits` i32[G, W] (group
    g's W positions, its last real one repeated past its drafts; a padding group repeats a position
    of a real group before it, so the smallest (group, offset) that names a position owns it).
    Positions no group names get group G - 1, offset 0: nothing reads their results."""
    G, W = group_logits.shape
    key = jnp.arange(G * W, dtype=jnp.int32)  # g * W + j, increasing in (g, j)
    owner = jnp.full((num_logits,), G * W, jnp.int32).at[group_logits.reshape(-1)].min(key)
    return jnp.minimum(owner // W, G - 1), jnp.where(owner < G * W, owner % W, 0)


def expand_positions(st: SamplingTensors, drafts: jax.Array, group: jax.Array, offset: jax.Array) -> SamplingTensors:
    """The sampling rows of every logit position: position j of group g samples output index step + j,
    and (for penalties) sees the history extended by the drafts d_1..d_j it follows. st [G], drafts
    i32[G, K], group / offset i32[L] -> [L]."""
    K = drafts.shape[1]
    at = jax.tree.map(lambda x: x[group], st)
    Lh = st.history.shape[-1]
    length = jnp.sum(at.history >= 0, axis=-1)  # i32[L]: prompt + output tokens held
    index = jnp.arange(Lh, dtype=jnp.int32)[None, :] - length[:, None]  # i32[L, Lh]: index into the drafts
    gathered = jnp.take_along_axis(drafts[group], jnp.clip(index, 0, K - 1), axis=1)
    use = (index >= 0) & (index < offset[:, None])
    return at.replace(step=at.step + offset, history=jnp.where(use, gathered, at.history))


def verify(
    logits: jax.Array,  # f32[L, V]  the target at each real logit position of the step
    group_logits: jax.Array,  # i32[G, W]  group g's positions in `logits`: pending token, then each draft (W = K + 1)
    drafts: jax.Array,  # i32[G, K]
    draft_probs: jax.Array | None,  # f32[G, K, V] processed draft distributions; None = point masses (ngram)
    num_draft: jax.Array,  # i32[G]  drafts to verify in each group (<= K; the rest is padding)
    st: SamplingTensors,  # [G] groups; step = output index of the first token decided here
    want_logprobs: jax.Array | None = None,  # bool[G]: groups that return logprobs (None: all)
    *,
    accept_all: bool = False,  # a deliberately wrong verifier (tests show the distribution test fails)
    # i32[Vd]: the target id of each of draft_probs' Vd columns (an EAGLE-3 head's draft vocabulary;
    # q is zero at every other id): draft_probs f32[G, K, Vd]. None: draft_probs spans the vocabulary.
    draft_vocab: jax.Array | None = None,
) -> VerifyOutput:
    """Vocabulary-wide work (penalties, argmax, filtering, softmax, top logprobs) runs once per real
    logit position, L of them, never per group slot: a step's groups are ragged (a plain decode is
    one position, a verification k + 1), so G * W slots would cost up to W times more. Only the
    acceptance arithmetic and two [G, V] rows (residual, bonus) are per group."""
    L, V = logits.shape
    G, W = group_logits.shape
    K = W - 1
    raw = logits.astype(jnp.float32)
    group, offset = positions_of(group_logits, L)
    st_l = expand_positions(st, drafts, group, offset)
    processed = penalise(raw, st_l)  # f32[L, V]
    sampled = st.temperature >= SAMPLING_EPS  # bool[G]
    in_run = jnp.arange(K, dtype=jnp.int32)[None, :] < num_draft[:, None]  # bool[G, K]
    at_run = lambda n: jnp.take_along_axis(group_logits, n[:, None], axis=1)[:, 0]  # noqa: E731  i32[G]

    def leading(accepted):  # i32[G]: accepted drafts before the first rejection
        return jnp.sum(jnp.cumprod(accepted & in_run, axis=1), axis=1).astype(jnp.int32)

    greedy = jnp.argmax(processed, axis=-1).astype(jnp.int32)[group_logits]  # i32[G, W]
    n_greedy = leading(jnp.ones_like(in_run) if accept_all else drafts == greedy[:, :K])
    final_greedy = jnp.take_along_axis(greedy, n_greedy[:, None], axis=1)[:, 0]

    def sampled_rows():
        filtered = filter_logits(processed, st_l, sampled[group])  # f32[L, V]
        p = jax.nn.softmax(filtered, axis=-1)
        follows = drafts[group, jnp.minimum(offset, K - 1)]  # i32[L]: the draft after each position
        p_d = jnp.take_along_axis(p, follows[:, None], axis=1)[:, 0][group_logits[:, :K]]  # f32[G, K]
        if draft_probs is None:
            q_d = jnp.ones_like(p_d)
        elif draft_vocab is None:
            q_d = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        else:  # each draft's column in the draft vocabulary (a head drafts only ids there; padding reads 0)
            column = jnp.full(V, -1, jnp.int32).at[draft_vocab].set(jnp.arange(draft_vocab.shape[0], dtype=jnp.int32))
            at = column[drafts]
            q_d = jnp.where(
                at >= 0, jnp.take_along_axis(draft_probs, jnp.maximum(at, 0)[..., None], axis=-1)[..., 0], 0.0
            )
        steps = st.step[:, None] + jnp.arange(K, dtype=jnp.int32)[None, :]
        keys = purpose_keys(jnp.repeat(st.seed, K), steps.reshape(-1), ACCEPT)
        u = jax.vmap(jax.random.uniform)(keys).reshape(G, K)
        # u < p/q, written without dividing; min(1, .) is implicit since u < 1.
        n = leading(jnp.ones_like(in_run) if accept_all else u * q_d < p_d)
        p_n = p[at_run(n)]  # f32[G, V]
        last = jnp.minimum(n, K - 1)[:, None]
        if draft_probs is None:
            q_n = jax.nn.one_hot(jnp.take_along_axis(drafts, last, axis=1)[:, 0], V, dtype=p.dtype)
        else:
            q_n = jnp.take_along_axis(draft_probs, last[:, :, None], axis=1)[:, 0]
            if draft_vocab is not None:  # laid over the vocabulary: [G, Vd] -> [G, V]
                q_n = jnp.zeros((G, V), q_n.dtype).at[:, draft_vocab].set(q_n)
        residual = jnp.maximum(p_n - q_n, 0.0)
        # A rejection implies p(d) < q(d), so the residual has mass; guard rounding all the same.
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
        # One draw per group: from the residual after a rejection (its own key), else the bonus token
        # (the normal sampler's key and logits); selecting key and logits first draws what two
        # separate draws would, with one Gumbel pass over [G, V] instead of two.
        rejected = (n < num_draft)[:, None]
        key = jax.random.wrap_key_data(
            jnp.where(
                rejected,
                jax.random.key_data(purpose_keys(st.seed, st.step + n, RESIDUAL)),
                jax.random.key_data(step_keys(st.seed, st.step + n)),
            )
        )
        final = jax.vmap(jax.random.categorical)(key, jnp.where(rejected, jnp.log(residual), filtered[at_run(n)]))
        return n, final.astype(jnp.int32)

    n_sampled, final_sampled = jax.lax.cond(
        jnp.any(sampled), sampled_rows, lambda: (jnp.zeros(G, jnp.int32), jnp.zeros(G, jnp.int32))
    )
    n = jnp.where(sampled, n_sampled, n_greedy)
    final = jnp.where(sampled, final_sampled, final_greedy)

    j = jnp.arange(W, dtype=jnp.int32)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((G, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j < n[:, None], padded, jnp.where(j == n[:, None], final[:, None], 0))
    top = min(MAX_LOGPROBS, V)

    def logprobs():
        lse = jax.nn.logsumexp(raw, axis=-1)  # f32[L]
        chosen = raw[group_logits, tokens] - lse[group_logits]  # f32[G, W]
        top_vals, top_ids = jax.lax.top_k(raw, top)  # [L, top]
        return (chosen, top_ids.astype(jnp.int32)[group_logits], (top_vals - lse[:, None])[group_logits])

    def none():
        return jnp.zeros((G, W), jnp.float32), jnp.zeros((G, W, top), jnp.int32), jnp.zeros((G, W, top), jnp.float32)

    # Skipped unless a group asks: a top-k over every position's vocabulary is the dearest pass.
    chosen, top_ids, top_logprobs = (
        logprobs() if want_logprobs is None else jax.lax.cond(jnp.any(want_logprobs), logprobs, none)
    )
    return VerifyOutput(tokens=tokens, num_accepted=n, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs)
