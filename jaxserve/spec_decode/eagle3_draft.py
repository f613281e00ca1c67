"""EAGLE-3 inside the speculative ragged step: the head's proposals before the target runs, and its
catch-up after.

The head at position p reads g_p (the target's aux states at p, fused by `fc`) and the token at
p + 1. Both of a row's passes follow from that shift:

* after the target (`catch_up`): the target has just written g for every token it computed, into
  the store of fused states kept beside the head's KV (`EagleCache.hidden`, one vector per page slot,
  so it follows pages through prefix caching and preemption like the KV). The head then runs over
  the step's tokens one position earlier: a row computing positions [s, s + T) gives the head
  positions [s - 1, s + T - 1) with the row's own tokens, g_{s-1} coming from the step before. So
  whatever the target computes, the head's cache keeps up in the same step: no lag to track. For a
  verification, positions past the accepted drafts hold rejected tokens; the next step rewrites them
  before any query reads them.
* before the target (`propose`): a group that verifies drafts starts at position n - 1 (n: its
  pending token, sampled by the last step), whose g the last step stored, with the pending token as
  input: that gives draft 1, then K - 1 chained steps each feed the previous draft and the head's own
  pre-norm output as the hidden (no target state exists for a draft).

The head's K/V at a page's last slot depends on the token after the page, so a prefix-cached page
shared by sequences that continue differently holds one of their continuations there: a draft may be
proposed from it (and rejected), never a wrong output.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.model.eagle3 import Eagle3Config, Eagle3Params, draft_logits, fuse, head_layer, target_logits
from jaxserve.model.kv_cache import (
    KVCache,
    RaggedBatch,
    attend,
    copy_pages_padded,
    init_cache,
    padded_page_chunks,
    write_kv_slots,
)
from jaxserve.model.layers import NO_SLIDING_WINDOW, rope_cos_sin
from jaxserve.model.llama import _embed
from jaxserve.model.ragged import PAD_SLOT, PADDING_PAGE, RaggedArrays, RaggedRow, pack_ragged
from jaxserve.model.sampler import SAMPLING_EPS, SamplingTensors
from jaxserve.model.sharding import per_replica
from jaxserve.model.step_options import StepOptions
from jaxserve.model.weights import Params
from jaxserve.model.attention_dispatch import ragged_attention_impl, runs_per_shard
from jaxserve.model.sharding import DATA


@flax.struct.dataclass
class EagleCache:
    """The head's device state beside the target's cache, over the same page ids."""

    kv: KVCache  # the head's one layer: k, v f[R, 1, K, NP, S, H]
    hidden: jax.Array  # f[R, NP * S, D]: g of every slot the target computed (its fused aux states)

    def copy_pages(self, replica: int, src: np.ndarray, dst: np.ndarray, width: int) -> EagleCache:
        """Copy-on-write for forked sequences, as the target's pages are copied: K/V and stored states."""
        kv = copy_pages_padded(self.kv, replica, src, dst, width)
        hidden = self.hidden
        for s, d in padded_page_chunks(src, dst, width):
            hidden = _copy_state_pages(hidden, s, d, replica=replica, page_size=self.kv.page_size)
        return EagleCache(kv=kv, hidden=hidden)


@functools.partial(jax.jit, static_argnames=("replica", "page_size"), donate_argnums=(0,))
def _copy_state_pages(hidden: jax.Array, src: jax.Array, dst: jax.Array, *, replica: int, page_size: int):
    R, slots, D = hidden.shape
    pages = hidden.reshape(R, slots // page_size, page_size, D)
    return pages.at[replica, dst].set(pages[replica, src]).reshape(R, slots, D)


def eagle_cache_sharding(shardings: Any) -> EagleCache | None:
    """The head's cache layout on a mesh (None on one device): its KV split like the target's, the
    stored states over the replicas."""
    if shardings is None:
        return None
    states = jax.sharding.NamedSharding(shardings.mesh, jax.sharding.PartitionSpec(DATA))
    return EagleCache(kv=KVCache(k=shardings.cache, v=shardings.cache), hidden=states)


def init_eagle_cache(cfg: Eagle3Config, target_cache: KVCache, dtype: Any, sharding: EagleCache | None) -> EagleCache:
    """Zeros over the target's page ids (allocated once, at start-up)."""
    R, _, _, NP, S, _ = target_cache.k.shape
    kv = init_cache(cfg.layer, NP, S, dtype, R, None if sharding is None else sharding.kv.k)
    zeros = jax.jit(lambda: jnp.zeros((R, NP * S, cfg.hidden_size), dtype), out_shardings=sharding and sharding.hidden)
    return EagleCache(kv=kv, hidden=zeros())


def eagle3_start_arrays(
    rows: Sequence[Any], pages: Sequence[Any], page_size: int, num_groups: int, num_rows: int, max_pages: int
) -> RaggedArrays:
    """One replica's `propose` input: group g (the g-th sampling row, a `StepRow`) as row g of one
    token, its first token at the position before it. A row starting at position 0 (a whole prompt)
    never verifies: it gets a placeholder on the padding page, which no sequence owns."""

    def start(r, p):
        if r.start_pos == 0:
            return RaggedRow([0], 0, [PADDING_PAGE])
        return RaggedRow([int(r.tokens[0])], r.start_pos - 1, p)

    return pack_ragged(
        [start(r, p) for r, p in zip(rows, pages)],
        page_size=page_size,
        num_tokens=num_groups,
        num_rows=num_rows,
        max_pages=max_pages,
        num_logits=num_groups,
    )


def _slots_at(batch: RaggedBatch, positions: jax.Array, page_size: int) -> jax.Array:
    """i32[N]: the slot of each token's row at `positions` (PAD_SLOT where negative or padding)."""
    rows = jnp.minimum(batch.token_row, batch.page_table.shape[0] - 1)
    page = jnp.take_along_axis(
        batch.page_table[rows], jnp.maximum(positions, 0)[:, None] // page_size, axis=1, mode="clip"
    )[:, 0]
    real = (positions >= 0) & (batch.slots >= 0)
    return jnp.where(real, page * page_size + positions % page_size, PAD_SLOT)


def _head_pass(
    hp: Eagle3Params,
    cfg: Eagle3Config,
    kv: KVCache,  # one replica
    batch: RaggedBatch,  # one replica: the head's positions and slots
    hidden: jax.Array,  # f[N, D]
    embeds: jax.Array,  # f[N, D]
    attention,
) -> tuple[jax.Array, KVCache]:
    """The head's layer over one replica's ragged batch, K/V written by slot first, then attention over
    its pages; returns the pre-norm output f[N, D] and the head's KV."""
    cos, sin = rope_cos_sin(batch.positions[None], cfg.layer)
    written = []
    sm_scale = jnp.float32(cfg.layer.head_dim**-0.5)

    def paged(q, k, v):
        written.append(write_kv_slots(kv, 0, k[0], v[0], batch.slots))
        return attend(attention, q[0], written[0], 0, batch, jnp.int32(NO_SLIDING_WINDOW), sm_scale)[None]

    out = head_layer(hp, cfg, embeds[None], hidden[None].astype(embeds.dtype), cos, sin, paged)
    return out[0], written[0]


def _embeds(hp: Eagle3Params, target: Params, target_cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """The head's token embeddings: its own table, or the target's (quantized tables too)."""
    return hp.embed[tokens] if hp.embed is not None else _embed(target, target_cfg, tokens)


def store_states(cache: EagleCache, hp: Eagle3Params, aux: jax.Array, slots: jax.Array) -> EagleCache:
    """Write g = fc(aux) at each token's slot: aux f[R, A, N, Dt] (the target's aux layers' states, in
    `aux_layers` order), slots i32[R, N] (padding dropped)."""
    R, A, N, Dt = aux.shape
    g = fuse(hp, jnp.moveaxis(aux, 1, 2).reshape(R, N, A * Dt)).astype(cache.hidden.dtype)
    size = cache.hidden.shape[1]
    at = jnp.where((slots >= 0) & (slots < size), slots, size)
    hidden = jax.vmap(lambda h, i, x: h.at[i].set(x, mode="drop"))(cache.hidden, at, g)
    return cache.replace(hidden=hidden)


def catch_up(
    hp: Eagle3Params,
    cfg: Eagle3Config,
    cache: EagleCache,
    target: Params,
    target_cfg: ModelConfig,
    batch: RaggedBatch,  # [R, N]: the target's step, drafts in place
    options: StepOptions,
) -> EagleCache:
    """After the target stored this step's states: the head over the step's tokens one position
    earlier (module docstring), writing its K/V; nothing is returned but the cache."""
    attention = ragged_attention_impl(options.attention_backend, options.mesh)
    page_size = cache.kv.k.shape[-2]

    def one(kv, hidden, b):
        positions = b.positions - 1
        slots = _slots_at(b, positions, page_size)
        shifted = b.replace(positions=positions, slots=slots, context_lens=jnp.maximum(b.context_lens - 1, 0))
        g = hidden[jnp.maximum(slots, 0)]
        _, kv = _head_pass(hp, cfg, kv, shifted, g, _embeds(hp, target, target_cfg, b.tokens), attention)
        return kv

    kv = jax.vmap(one, spmd_axis_name=_spmd(options))(cache.kv, cache.hidden, batch)
    return cache.replace(kv=kv)


def _spmd(options: StepOptions):
    """The replica vmap's axis name where the attention runs per shard (as `ragged_step` maps it)."""
    return DATA if runs_per_shard(options.attention_backend, options.mesh) else None


def propose(
    hp: Eagle3Params,
    cfg: Eagle3Config,
    cache: EagleCache,
    target: Params,
    target_cfg: ModelConfig,
    start: RaggedBatch,  # [R, G]: each group's pending token at position n - 1 (its slot and pages)
    num_draft: jax.Array,  # i32[R, G]
    sampling: SamplingTensors,  # [R, G]
    verifying: jax.Array,  # bool[]
    draw,  # spec_decode.draft._draw
    *,
    options: StepOptions,
    num_tokens: int,  # K, static
) -> tuple[jax.Array, jax.Array, EagleCache]:
    """Drafts i32[R, G, K], their distributions over the draft vocabulary f32[R * G, K, Vd] (q is zero
    at every other id: `rejection.verify`'s draft_vocab) and the cache (module docstring).
    Unrolled over K like the draft model's proposals; an idle group recomputes its last position,
    writing nothing, and the steps past the most drafts any group verifies are skipped (a verify of
    one draft runs the head once, not K times). With every row greedy and unbiased a draft is the
    argmax over the draft vocabulary, mapped to the target's (no target-vocabulary pass)."""
    R, G = num_draft.shape
    V, Vd = target_cfg.vocab_size, cfg.draft_vocab_size
    attention = ragged_attention_impl(options.attention_backend, options.mesh)
    page_size = cache.kv.k.shape[-2]

    def sample(prenorm, j):  # [R, G, D] -> tokens [R, G], q [R * G, Vd]
        small = draft_logits(hp, cfg, prenorm)  # f32[R, G, Vd]

        def drawn():  # a row samples or biases logits: the draw over the target's vocabulary
            logits = target_logits(hp, small, V)

            def replicas(logits, st):
                n = logits.shape[0] * G
                flat = jax.tree.map(lambda x: x.reshape((n,) + x.shape[2:]), st)
                token, q = draw(logits.reshape(n, -1), flat, j)
                return token.reshape(logits.shape[:2]), q.reshape(logits.shape)

            token, q = per_replica(replicas, options.mesh)(logits, sampling)
            return token, q.reshape(R * G, -1)[:, hp.draft_to_target]  # zero elsewhere: not kept

        def greedy():  # every row greedy, unbiased: the argmax of the draft vocabulary, mapped (no q read)
            token = hp.draft_to_target[jnp.argmax(small, axis=-1)].astype(jnp.int32)
            return token, jnp.zeros((R * G, Vd), jnp.float32)

        plain = ~jnp.any(sampling.temperature >= SAMPLING_EPS) & ~jnp.any(sampling.bias_ids >= 0)
        return jax.lax.cond(plain, greedy, drawn)

    def run(cache):
        g = jax.vmap(lambda h, s: h[jnp.maximum(s, 0)])(cache.hidden, start.slots)  # f[R, G, D]
        most = jnp.max(num_draft)  # head steps past the most any group verifies are skipped
        head = functools.partial(_head_pass, hp, cfg, attention=attention)

        def head_step(j, carry):  # draft j + 1 of every group; the next step's inputs
            kv, step, hidden, tokens = carry
            embeds = jax.vmap(lambda t: _embeds(hp, target, target_cfg, t))(tokens)
            prenorm, kv = jax.vmap(head, spmd_axis_name=_spmd(options))(kv, step, hidden, embeds)
            token, q = sample(prenorm, j)
            active = j + 1 < num_draft
            pos = jnp.where(active, start.positions + j + 1, start.positions)
            slots = jax.vmap(functools.partial(_slots_at, page_size=page_size))(step.replace(slots=start.slots), pos)
            step = start.replace(
                positions=pos,
                slots=jnp.where(active, slots, PAD_SLOT),
                # rows are groups (G of them, then padding rows to the batch's S)
                context_lens=start.context_lens.at[:, :G].add(jnp.where(active, j + 1, 0)),
            )
            return (kv, step, prenorm, token), token, q

        carry, drafts, probs = (cache.kv, start, g, start.tokens), [], []
        for j in range(num_tokens):
            if j == 0:  # some group verifies (run's condition): it needs draft 1
                carry, token, q = head_step(0, carry)
            else:
                carry, token, q = jax.lax.cond(
                    j < most,
                    functools.partial(head_step, j),
                    lambda c: (c, jnp.zeros((R, G), jnp.int32), jnp.zeros((R * G, Vd), jnp.float32)),
                    carry,
                )
            drafts.append(token)
            probs.append(q)
        return jnp.stack(drafts, axis=-1), jnp.stack(probs, axis=1), cache.replace(kv=carry[0])

    def idle(cache):
        return jnp.zeros((R, G, num_tokens), jnp.int32), jnp.zeros((R * G, num_tokens, Vd), jnp.float32), cache

    return jax.lax.cond(verifying, run, idle, cache)
