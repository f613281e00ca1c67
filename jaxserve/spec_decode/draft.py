"""The draft model's proposals inside the speculative ragged step: its catch-up over every row, then
k autoregressive single-token steps of the verifying groups over its paged cache.

The draft's cache uses the target's page ids and page tables (one block manager): only the arrays
differ. Its first step takes what its cache lacks up to each row's last token (a prompt chunk's
tokens; the pending token, or two tokens after a fully accepted run whose last draft it never
consumed); each later step feeds the previous draft. Draft j is written at position pos + j only
while j < the group's draft count, so a row never writes past the pages it was given.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import KVCache, RaggedBatch
from jaxserve.model.ragged import PAD_SLOT
from jaxserve.model.weights import Params
from jaxserve.model.sampler import SAMPLING_EPS, SamplingTensors, apply_logit_bias, filter_logits
from jaxserve.model.sharding import per_replica
from jaxserve.spec_decode.rejection import DRAFT, purpose_keys
from jaxserve.model.ragged_step import ragged_step
from jaxserve.model.step_options import StepOptions


def _draw(logits: jax.Array, st: SamplingTensors, j: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draft token i32[N] and the distribution it was drawn from f32[N, V] (zeros for greedy rows:
    verification never reads them). The draft takes the row's logit_bias and temperature / top-k /
    top-p / min-p, not its penalties: any q keeps the target's distribution exact, and a close one is
    accepted more (a +100 bias the draft ignored would have every draft rejected)."""
    logits = jax.lax.cond(jnp.any(st.bias_ids >= 0), lambda: apply_logit_bias(logits, st), lambda: logits)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = st.temperature >= SAMPLING_EPS

    def draw():
        filtered = filter_logits(logits, st, sampled)
        token = jax.vmap(jax.random.categorical)(purpose_keys(st.seed, st.step + j, DRAFT), filtered)
        return jnp.where(sampled, token.astype(jnp.int32), greedy), jax.nn.softmax(filtered, axis=-1)

    return jax.lax.cond(jnp.any(sampled), draw, lambda: (greedy, jnp.zeros_like(logits)))


def propose_ragged(
    params: Params,
    cache: KVCache,
    draft: Any,  # spec_decode.step.DraftInputs
    num_draft: jax.Array,  # i32[R, G]  drafts wanted per sampling group (<= num_tokens)
    sampling: SamplingTensors,  # [R, G] groups, step = output index of draft 1
    verifying: jax.Array,  # bool[]: some group wants drafts
    *,
    cfg: ModelConfig,
    options: StepOptions,
    num_tokens: int,  # K, static
) -> tuple[jax.Array, jax.Array, KVCache]:
    """Returns drafts i32[R, G, K], their distributions f32[R * G, K, V] and the draft cache.

    The draft first takes every row's tokens its cache lacks (`draft.batch`: prompt chunks too, so
    the draft's cache keeps up with the target's in the same call) and returns each group's logits at
    its last token: draft 1 of a verifying group (whose last token there is its pending one). Then,
    only when some group verifies, K - 1 single-token steps of the groups (unrolled: K is small and
    static; under a `while` loop XLA:CPU copied the loop-carried cache every iteration). A group
    wanting fewer drafts computes the later steps at its last position again and writes nothing."""
    R, G = num_draft.shape
    logits, cache = ragged_step(params, cache, draft.batch, cfg, options)  # f32[R, G, V]
    page_size = cache.k.shape[-2]
    pages = jnp.take_along_axis(draft.batch.page_table, draft.group_row[..., None], axis=1)  # i32[R, G, P]
    last = jnp.take_along_axis(draft.batch.positions, draft.batch.logit_index, axis=1)  # i32[R, G]
    rows = jnp.broadcast_to(jnp.arange(G, dtype=jnp.int32), (R, G))
    starts = jnp.broadcast_to(jnp.arange(G + 1, dtype=jnp.int32), (R, G + 1))

    def draw_replicas(logits, st, *, j):  # [R', G, V] of all replicas or one data shard's
        n = logits.shape[0] * G
        token, q = _draw(logits.reshape(n, -1), jax.tree.map(lambda x: x.reshape((n,) + x.shape[2:]), st), j)
        return token.reshape(logits.shape[:2]), q.reshape(logits.shape)

    def draw(logits, j):  # each replica's groups on its own devices (sharding.per_replica)
        token, q = per_replica(functools.partial(draw_replicas, j=j), options.mesh)(logits, sampling)
        return token, q.reshape(R * G, -1)

    def propose(cache):
        token, q = draw(logits, 0)
        tokens, probs = [token], [q]
        for j in range(1, num_tokens):
            active = j < num_draft
            pos = jnp.where(active, last + j, last)  # an idle group recomputes its last token, writing nothing
            page = jnp.take_along_axis(pages, (pos // page_size)[..., None], axis=-1)[..., 0]
            slots = jnp.where(active, page * page_size + pos % page_size, PAD_SLOT)
            step = RaggedBatch(
                tokens=tokens[-1],
                positions=pos,
                slots=slots,
                token_row=rows,
                query_start=starts,
                context_lens=pos + 1,
                page_table=pages,
                logit_index=rows,
            )
            step_logits, cache = ragged_step(params, cache, step, cfg, options)
            token, q = draw(step_logits, j)
            tokens.append(token)
            probs.append(q)
        return jnp.stack(tokens, axis=-1), jnp.stack(probs, axis=1), cache

    def idle(cache):
        V = logits.shape[-1]
        return (jnp.zeros((R, G, num_tokens), jnp.int32), jnp.zeros((R * G, num_tokens, V), jnp.float32), cache)

    return jax.lax.cond(verifying, propose, idle, cache)
