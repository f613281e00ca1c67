"""The speculative ragged step: a speculative engine's every step, one executable per token bucket.

Its rows are those of the plain ragged step (prompt chunks, decodes) plus verifications: a decode
row carrying `k` drafts has k + 1 tokens [pending, d_1..d_k] and k + 1 logits. The forward returns
hidden states at the step's real logit positions only (`logit_index`, at most N of them), and the
sampling rows see them in groups of W = K + 1 (`SpecRows.group_logits`: group g's position 0 is the
logit of its first new token, positions 1..k its drafts'); a group with no drafts is a plain
sample. In one call:

1. the draft model (method "draft") takes every row's tokens its cache lacks (a prompt chunk, or
   the pending token and the one before it after a fully accepted run) and proposes up to K tokens
   per verifying group, scattered into the target's token axis (the host's n-gram proposals are
   there already);
2. the target runs the ragged forward over every row and keeps the final hidden states of the
   grouped logit positions;
3. if some group verifies, every real position gets logits and `rejection.verify` accepts on
   device (its vocabulary-wide passes run per real position, not per group slot); otherwise only
   position 0 of each group does and `sampling.sample` draws (a plain step pays for one vocabulary
   matmul per row, not W). Buckets of at most G real logits (N <= max rows) have the verifier
   alone, since it samples a group without drafts exactly as the sampler does and one branch
   compiles faster; the 1-token bucket, where nothing verifies, has the sampler alone.

K/V written for drafts that end up rejected sit past the sequence's length and are overwritten by
later steps. The runner lowers, compiles and calls it (`jaxserve.runner.speculative`).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import KVCache, RaggedBatch
from jaxserve.model.weights import Params
from jaxserve.model.sampler import MAX_LOGPROBS, SamplingTensors, sample
from jaxserve.model.sharding import per_replica
from jaxserve.model.hidden_states import HiddenStates
from jaxserve.spec_decode import eagle3_draft
from jaxserve.spec_decode.draft import _draw, propose_ragged
from jaxserve.spec_decode.rejection import VerifyOutput, verify
from jaxserve.model.ragged_step import ragged_logits, ragged_step
from jaxserve.model.step_options import StepOptions


@dataclasses.dataclass(frozen=True)
class SpecOptions:
    """Static choices of the speculative step (part of its compilation key)."""

    method: str  # "draft" | "eagle3" | "ngram"
    num_tokens: int  # K: the most drafts a group verifies; groups are K + 1 logits wide
    accept_all: bool = False  # a deliberately wrong verifier, only for the test that must catch it


@flax.struct.dataclass
class SpecRows:
    """Per sampling group g of each replica: what it verifies."""

    num_draft: jax.Array  # i32[R, G]  drafts to verify (0: a plain sample)
    want_logprobs: jax.Array  # bool[R, G]  groups that return logprobs (the top-N costs a vocabulary-wide top-k)
    # i32[R, G * W]  group g's W logits as indices into the step's logit_index (its last real one
    # repeated past its drafts; padding groups 0)
    group_logits: jax.Array


@flax.struct.dataclass
class DraftInputs:
    """The draft's share of a step (methods "draft" and "eagle3"), per replica."""

    # Every row's tokens the draft's cache lacks, on the step's axis of N (never more than the row's
    # own): a prompt chunk's tokens; a decode row's pending token, after the token before it when the
    # last step accepted every draft (the draft never fed its last one; a row verifying nothing then
    # takes that one alone). logit_index i32[G]: each group's last token.
    # EAGLE-3: [R, G], one token per group: its pending token at position n - 1, rows = groups
    # (`eagle3_draft.propose`).
    batch: RaggedBatch
    draft_index: jax.Array  # i32[R, G, K]  where draft j of group g goes on the target's token axis; N: nowhere
    group_row: jax.Array  # i32[R, G]  the row of each group (its page table)


def constrain(cache: KVCache | None, shardings: KVCache | None) -> KVCache | None:
    """Keep a donated cache's layout stable from step to step (shardings: a KVCache of shardings)."""
    if cache is None or shardings is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, shardings)


def _plain_output(out, width: int) -> VerifyOutput:
    """A plain sample [N] as a VerifyOutput of no accepted drafts ([N, width] padded with zeros)."""

    def pad(x):
        return jnp.zeros((x.shape[0], width) + x.shape[1:], x.dtype).at[:, 0].set(x)

    return VerifyOutput(
        tokens=pad(out.tokens),
        num_accepted=jnp.zeros_like(out.tokens),
        logprobs=pad(out.logprobs),
        top_ids=pad(out.top_ids),
        top_logprobs=pad(out.top_logprobs),
    )


def speculative_step(
    params: Params,
    cache: KVCache,
    draft_params: Params | None,
    draft_cache: KVCache | None,
    batch: RaggedBatch,  # [R, N]; logit_index [R, min(N, G * W)]: the real logits, row by row
    sampling: SamplingTensors,  # [R, G]
    rows: SpecRows,
    draft: DraftInputs | None,
    *,
    cfg: ModelConfig,
    draft_cfg: ModelConfig | None,
    options: StepOptions,
    spec: SpecOptions,
    cache_sharding: KVCache | None = None,
    draft_cache_sharding: KVCache | None = None,
) -> tuple[VerifyOutput, KVCache, KVCache | None]:
    """VerifyOutput with leading axes [R, G] (tokens [R, G, W]: the accepted drafts, then the
    target's token), and both caches."""
    R, G = rows.num_draft.shape
    K, W = spec.num_tokens, spec.num_tokens + 1
    verifying = jnp.any(rows.num_draft > 0)
    draft_probs = None
    if spec.method in ("draft", "eagle3"):
        if spec.method == "draft":
            drafts, draft_probs, draft_cache = propose_ragged(
                draft_params,
                draft_cache,
                draft,
                rows.num_draft,
                sampling,
                verifying,
                cfg=draft_cfg,
                options=options,
                num_tokens=K,
            )
        else:
            drafts, draft_probs, draft_cache = eagle3_draft.propose(
                draft_params,
                draft_cfg,
                draft_cache,
                params,
                cfg,
                draft.batch,
                rows.num_draft,
                sampling,
                verifying,
                _draw,
                options=options,
                num_tokens=K,
            )
        draft_cache = constrain(draft_cache, draft_cache_sharding)
        tokens = jax.vmap(lambda t, at, d: t.at[at.reshape(-1)].set(d.reshape(-1), mode="drop"))(
            batch.tokens, draft.draft_index, drafts
        )
        batch = batch.replace(tokens=tokens)
    if spec.method == "eagle3":
        hidden, cache, draft_cache = _target_with_states(
            params, cache, draft_params, draft_cache, batch, cfg, draft_cfg, options
        )
        draft_cache = constrain(draft_cache, draft_cache_sharding)
    else:
        hidden, cache = ragged_step(params, cache, batch, cfg, options, hidden=True)  # f[R, L, D]
    cache = constrain(cache, cache_sharding)
    # Each group's tokens at its logit positions: [pending or last, d_1..d_K] (padding past its drafts).
    at = jnp.take_along_axis(batch.logit_index, rows.group_logits, axis=1)  # i32[R, G * W]: token index
    drafts = jnp.take_along_axis(batch.tokens, at, axis=1).reshape(R * G, W)[:, 1:]

    def verify_groups():  # every real position gets logits; each replica's groups index its own
        logits = ragged_logits(params, hidden, cfg, options)  # f32[R, L, V]
        probs = None if draft_probs is None else draft_probs.reshape((R, G) + draft_probs.shape[1:])
        # EAGLE-3's q covers its draft vocabulary only (one copy per replica, for per_replica's split)
        vocab = None
        if spec.method == "eagle3":
            vocab = jnp.broadcast_to(draft_params.draft_to_target, (R,) + draft_params.draft_to_target.shape)
        return per_replica(functools.partial(_verify_replicas, accept_all=spec.accept_all), options.mesh)(
            logits,
            rows.group_logits,
            drafts.reshape(R, G, K),
            probs,
            rows.num_draft,
            sampling,
            rows.want_logprobs,
            vocab,
        )

    def sample_groups():  # no group verifies: position 0 of each only
        first = jnp.take_along_axis(hidden, rows.group_logits[:, ::W, None], axis=1)  # f[R, G, D]
        logits = ragged_logits(params, first, cfg, options)  # f32[R, G, V]
        out = per_replica(lambda x, at: sample(x, at, want_logprobs=MAX_LOGPROBS), options.mesh)(logits, sampling)
        out = _plain_output(jax.tree.map(lambda x: x.reshape((R * G,) + x.shape[2:]), out), W)
        return jax.tree.map(lambda x: x.reshape((R, G) + x.shape[1:]), out)

    N, L = batch.tokens.shape[1], batch.logit_index.shape[1]
    if N < 2:  # no row of one token holds a draft
        out = sample_groups()
    elif L <= G:  # as many real logits as groups: verifying costs the sampler's vocabulary matmul, one
        out = verify_groups()  # branch compiles faster, and a group with no drafts samples as the sampler does
    else:
        out = jax.lax.cond(verifying, verify_groups, sample_groups)
    return out, cache, draft_cache


def _target_with_states(params, cache, head, head_cache, batch, cfg, head_cfg, options):
    """EAGLE-3's target pass: the forward keeps the head's aux layers' states at every token, stores
    them fused at the tokens' slots, and the head catches up over the step (`eagle3_draft`). Returns
    the final-normed states at the logit positions f[R, L, D] and both caches."""
    R, N = batch.tokens.shape
    states = HiddenStates(layers=head_cfg.aux_layers, final=True, logits=False)
    every = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (R, N))
    out, cache = ragged_step(params, cache, batch, cfg, options, states=states, state_index=every)
    hidden = jnp.take_along_axis(out.final, batch.logit_index[..., None], axis=1)
    head_cache = eagle3_draft.store_states(head_cache, head, out.layers, batch.slots)
    head_cache = eagle3_draft.catch_up(head, head_cfg, head_cache, params, cfg, batch, options)
    return hidden, cache, head_cache


def _verify_replicas(
    logits, group_logits, drafts, draft_probs, num_draft, sampling, want_logprobs, draft_vocab, *, accept_all
):
    """`verify` of the groups of replicas [R', ...] (all of them, or one data shard's): logits
    f32[R', L, V], group_logits i32[R', G * W] (positions in the replica's own logits), draft_vocab
    i32[R', Vd] or None (the same per replica), the rest [R', G, ...]; returns a VerifyOutput [R', G, ...]."""
    R, L = logits.shape[:2]
    G = num_draft.shape[1]
    W = group_logits.shape[1] // G
    positions = group_logits.reshape(R, G, W) + L * jnp.arange(R, dtype=jnp.int32)[:, None, None]

    def flat(x):
        return x.reshape((R * G,) + x.shape[2:])

    out = verify(
        logits.reshape(R * L, -1),
        positions.reshape(R * G, W),
        flat(drafts),
        None if draft_probs is None else flat(draft_probs),
        flat(num_draft),
        jax.tree.map(flat, sampling),
        flat(want_logprobs),
        accept_all=accept_all,
        draft_vocab=None if draft_vocab is None else draft_vocab[0],
    )
    return jax.tree.map(lambda x: x.reshape((R, G) + x.shape[1:]), out)
