"""The functions every plain bucket compiles: one ragged step (the forward, then a sample per row),
its prompt-scoring variant and its multi-step variant; `generate_states_step` is the ragged step that
also returns hidden states (for EAGLE-3's target step). Each takes (params, cache, carried tokens,
sparse sampling inputs, the packed inputs: `jaxserve.model.transfer`) and returns (samples, cache,
carried tokens); the cache is donated."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.model.kv_cache import RaggedBatch
from jaxserve.model.placeholders import carry_tokens, resolve
from jaxserve.model.ragged import PAD_SLOT
from jaxserve.model.sampler import MAX_LOGPROBS, SamplingTensors, sample
from jaxserve.model.sharding import per_replica
from jaxserve.model.transfer import from_buffer, with_sparse
from jaxserve.runner.step_io import PromptScores
from jaxserve.model.ragged_step import ragged_step
from jaxserve.structured.apply import mask_logits


def _take_carried(batch: RaggedBatch, sampling: SamplingTensors, carried: jax.Array):
    """The step's inputs with every placeholder (`jaxserve.model.placeholders`: a token the previous step
    sampled, not yet on the host) replaced by that step's carried token: in the tokens computed and
    in the penalty histories."""
    return (
        batch.replace(tokens=resolve(batch.tokens, carried)),
        sampling.replace(history=resolve(sampling.history, carried)),
    )


def _constrain(x, sharding):
    """`x` laid out as `sharding` says; None: as XLA chooses. The donated cache keeps its layout from
    step to step; on a mesh spanning processes the samples are replicated, so every process reads them."""
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _carry(tokens: jax.Array, carried: jax.Array, carry_sharding=None) -> jax.Array:
    """The tokens the next step's placeholders name: this step's samples i32[R, L] at carried's width."""
    return _constrain(carry_tokens(tokens, carried.shape[-1]), carry_sharding)


def _forward_and_sample(params, cache, batch, sampling, mask, cfg, options, cache_sharding=None):
    """The forward of a step whose inputs are whole (placeholders resolved), then a sample per row
    that samples: (samples [R, L], cache)."""
    logits, cache = ragged_step(params, cache, batch, cfg, options)  # f32[R, L, V]
    cache = _constrain(cache, cache_sharding)
    return sample_per_replica(logits, mask, sampling, options), cache


def sample_per_replica(logits, mask, sampling, options):
    """`sample` of logits [R, L, V] under their grammar masks, each replica's rows on its own devices
    (`sharding.per_replica` over `options.mesh`), their logprobs as `options.logprobs_mode` says (every
    step that samples reports the same kind). Masks first, so every sampler transform (and the logprobs) sees only
    allowed tokens. Top logprobs under a cond inside `sample` (only steps where a row asks pay for
    the top-k): one executable, where a second compiled variant per bucket would double start-up."""

    def one(x, m, st):
        return sample(mask_logits(x, m), st, want_logprobs=MAX_LOGPROBS, logprobs_mode=options.logprobs_mode)

    return per_replica(one, options.mesh)(logits, mask, sampling)


def _generate_step(
    params,
    cache,
    carried,
    sparse,
    batch,
    sampling,
    mask,
    cfg,
    options,
    cache_sharding=None,
    out_sharding=None,
    carry_sharding=None,
):
    """One ragged step: the forward, then a sample per row that samples. `carried` i32[R, S]: the
    previous step's samples (what placeholders name); `sparse`: the SPARSE_FIELDS of `sampling`;
    returns (samples [R, L], cache, carried)."""
    batch, sampling = _take_carried(batch, with_sparse(sampling, sparse), carried)
    out, cache = _forward_and_sample(params, cache, batch, sampling, mask, cfg, options, cache_sharding)
    out = _constrain(out, out_sharding)
    return out, cache, _carry(out.tokens, carried, carry_sharding)


# The compiled steps take (params, cache, carried tokens, packed inputs): see jaxserve.model.transfer.
_STATIC = ("layout", "cfg", "options", "cache_sharding", "out_sharding", "carry_sharding")
generate_step = jax.jit(from_buffer(_generate_step, 4), static_argnames=_STATIC, donate_argnums=(1,))


def _next_decode_batch(batch: RaggedBatch, tokens: jax.Array, active: jax.Array, page_size: int) -> RaggedBatch:
    """The next decode step of a pure-decode batch (row r's one token at index r, its logit r): each
    active row feeds the token it sampled at the next position; inactive rows write nothing."""
    S = batch.context_lens.shape[-1]
    row = jnp.minimum(batch.token_row, S - 1)  # padding tokens: any row, masked below
    take = jax.vmap(lambda x, i: x[i])
    tok_active = take(active, row) & (batch.token_row < S)  # bool[R, N]
    positions = batch.positions + tok_active
    pages = take(batch.page_table, row)  # i32[R, N, P]: each token's row's page table
    last = pages.shape[-1] - 1  # an inactive token's position may pass its table: clamped, then dropped
    page = jnp.take_along_axis(pages, jnp.minimum(positions // page_size, last)[..., None], -1)[..., 0]
    slots = jnp.where(tok_active, page * page_size + positions % page_size, PAD_SLOT)
    next_tokens = jnp.where(tok_active, take(tokens, jnp.minimum(row, tokens.shape[-1] - 1)), batch.tokens)
    return batch.replace(
        tokens=next_tokens.astype(jnp.int32), positions=positions, slots=slots, context_lens=batch.context_lens + active
    )


def _multi_decode_step(
    params,
    cache,
    carried,
    sparse,
    batch,
    sampling,
    mask,
    steps,
    cfg,
    options,
    num_steps,
    page_size,
    cache_sharding=None,
    out_sharding=None,
    carry_sharding=None,
):
    """`num_steps` decode steps in one call (num_scheduler_steps): each feeds the token it sampled to
    the next, so the host is not needed in between. Row r takes part in its first steps[r] steps and
    writes nothing after (its pages beyond those are not its own). Samples: [num_steps, R, L, ...].
    The grammar masks hold for the first step only: the engine gives constrained rows one step.
    Multi-step engines run serially (no step follows this one before its samples are on the host),
    so `carried` is passed through unchanged."""
    batch, sampling = _take_carried(batch, with_sparse(sampling, sparse), carried)

    def one(carry, k):
        cache, batch, sampling = carry
        now = mask.replace(constrained=mask.constrained & (k == 0))
        out, cache = _forward_and_sample(params, cache, batch, sampling, now, cfg, options, cache_sharding)
        batch = _next_decode_batch(batch, out.tokens, k + 1 < steps, page_size)
        return (cache, batch, sampling.advanced(out.tokens)), out

    (cache, _, _), out = jax.lax.scan(one, (cache, batch, sampling), jnp.arange(num_steps, dtype=jnp.int32))
    out = _constrain(out, out_sharding)
    return out, cache, carried


multi_decode_step = jax.jit(
    from_buffer(_multi_decode_step, 4), static_argnames=_STATIC + ("num_steps", "page_size"), donate_argnums=(1,)
)


def _score_step(
    params,
    cache,
    carried,
    sparse,
    batch,
    sampling,
    mask,
    sample_index,
    targets,
    cfg,
    options,
    cache_sharding=None,
    out_sharding=None,
    carry_sharding=None,
):
    """A step that also scores every token (prompt_logprobs): `batch.logit_index` lists all N tokens,
    `sample_index` i32[R, L] the ones that sample."""
    batch, sampling = _take_carried(batch, with_sparse(sampling, sparse), carried)
    logits, cache = ragged_step(params, cache, batch, cfg, options)  # f32[R, N, V]
    cache = _constrain(cache, cache_sharding)
    sampled = sample_per_replica(jnp.take_along_axis(logits, sample_index[..., None], axis=1), mask, sampling, options)
    logp = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logp, MAX_LOGPROBS)
    target = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    out = (sampled, PromptScores(target, top_ids, top_logprobs))
    out = _constrain(out, out_sharding)
    return out, cache, _carry(sampled.tokens, carried, carry_sharding)


score_step = jax.jit(from_buffer(_score_step, 4), static_argnames=_STATIC, donate_argnums=(1,))


def _generate_states_step(
    params,
    cache,
    carried,
    sparse,
    batch,
    sampling,
    mask,
    state_index,
    cfg,
    options,
    states,
    cache_sharding=None,
    out_sharding=None,
    carry_sharding=None,
):
    """The ragged step that also returns hidden states (`model/hidden_states.py`): a sample per row
    that samples, as `generate_step`, and `states`' layers / final-normed state at `state_index`
    i32[R, M] (EAGLE-3: the aux layers at the tokens of the rows that speculate). Returns ((samples,
    HiddenOutput without its logits), cache, carried); `states` is static, so an engine that never
    compiles this compiles nothing new."""
    batch, sampling = _take_carried(batch, with_sparse(sampling, sparse), carried)
    wanted = dataclasses.replace(states, logits=True)
    hidden, cache = ragged_step(params, cache, batch, cfg, options, states=wanted, state_index=state_index)
    cache = _constrain(cache, cache_sharding)
    sampled = sample_per_replica(hidden.logits, mask, sampling, options)
    out = (sampled, hidden.replace(logits=None))
    out = _constrain(out, out_sharding)
    return out, cache, _carry(sampled.tokens, carried, carry_sharding)


generate_states_step = jax.jit(
    from_buffer(_generate_states_step, 4), static_argnames=_STATIC + ("states",), donate_argnums=(1,)
)
