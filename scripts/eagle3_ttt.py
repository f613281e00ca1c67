"""EAGLE-3's training-time test in JAX: the head unrolled over a few draft steps, its loss and its
held-out acceptance, on packed rows of training sequences.

The head's math is `jaxserve.model.eagle3` (the functions serving runs); this module supplies what
only training needs, following speculators' Eagle3 trainer (its semantics are written down in the
issue-54 notes):

* Rows hold several sequences back to back (`doc` ids, -1 for padding). Row index i of a sequence
  holds the token at position i + 1, the target's aux states at position i, and the target's
  distribution for the token at i + 2 (the states at i + 1 through its final norm and lm_head,
  restricted to the draft vocabulary).
* Step 0 fuses the aux states (`fc`); step s > 0 feeds the head its own pre-norm output of step s - 1
  at the same index and the token s places further on (teacher forcing with the ground truth, as
  speculators does), at position + s. Its attention sees the step-0 keys of its own sequence up to
  its index and, of every later step, only its own index's key: the chain a drafting step sees.
* Loss: per step, KL(target || draft) over the draft vocabulary at the answer tokens, a masked mean,
  weighted decay ** s, summed over steps (speculators' kl_div with ttt_step_loss_decay).
* Held-out acceptance: the same unroll fed the head's OWN greedy tokens (exactly what drafting does),
  each step's draft mapped to target ids and compared with the target's greedy token; a draft counts
  only if every earlier one in its chain was accepted.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.model import eagle3
from jaxserve.model.layers import rope_cos_sin


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """Packed rows, [B, T] unless noted. `aux` f[B, T, 3 * Dt], `final` f[B, T, D] (the target's
    final-normed state for the token after `tokens`' one), `greedy` the target's greedy next token
    after it (target ids), `mask` the indices the loss and acceptance count (answer tokens)."""

    tokens: jax.Array  # i32: the token at each index's position (target ids)
    positions: jax.Array  # i32: its position in its sequence
    doc: jax.Array  # i32: which sequence of the row (-1: padding)
    aux: jax.Array
    final: jax.Array
    greedy: jax.Array  # i32
    mask: jax.Array  # bool


def shift(x: jax.Array, s: int, fill=0) -> jax.Array:
    """x[:, i + s] at index i along axis 1 (`fill` past the end)."""
    if s == 0:
        return x
    pad = jnp.full((x.shape[0], s) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, s:], pad], axis=1)


def ttt_attention(q, k, v, doc, past_k: list, past_v: list, scale: float):
    """Dense attention of one unrolled step. q f[B, T, N, H]; k, v f[B, T, K, H] this step's;
    `past_k`/`past_v`: step 0's and then the later steps' (each f[B, T, K, H]), step 0 first.
    Step 0's keys are seen causally within the same sequence, each later step's only at the query's
    own index. Returns f[B, T, N, H]."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H).astype(jnp.float32) * scale
    keys0, values0 = (past_k[0], past_v[0]) if past_k else (k, v)
    diag_k = past_k[1:] + [k] if past_k else []
    diag_v = past_v[1:] + [v] if past_v else []
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, keys0.astype(jnp.float32))
    i = jnp.arange(T)
    seen = (i[:, None] >= i[None, :]) & (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)
    scores = jnp.where(seen[:, None, None], scores, -1e30)
    # the diagonal keys of the later steps: one score per (query, step)
    diag = [jnp.einsum("btkgh,btkh->bkgt", qg, dk.astype(jnp.float32))[..., None] for dk in diag_k]
    allscores = jnp.concatenate([scores] + diag, axis=-1)
    weights = jax.nn.softmax(allscores, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", weights[..., :T], values0.astype(jnp.float32))
    for j, dv in enumerate(diag_v):
        out = out + jnp.einsum("bkgt,btkh->btkgh", weights[..., T + j], dv.astype(jnp.float32))
    return out.reshape(B, T, N, H).astype(q.dtype)


def unroll(params, cfg, embed, batch: Batch, steps: int, feed_own: bool = False, noise=None):
    """The head over `steps` unrolled draft steps: draft-vocabulary logits f32[steps, B, T, Vd].
    `feed_own`: step s + 1 is fed step s's greedy draft (evaluation) instead of the ground truth.
    `noise`: added to the aux states (speculators' augmentation) when given."""
    aux = batch.aux if noise is None else batch.aux + noise
    hidden = eagle3.fuse(params, aux.astype(params.fc.dtype))
    scale = cfg.layer.head_dim**-0.5
    past_k: list = []
    past_v: list = []
    tokens = batch.tokens
    logits_all = []
    for s in range(steps):
        embeds = embed[tokens].astype(hidden.dtype)
        cos, sin = rope_cos_sin(batch.positions + s, cfg.layer)

        def attend(q, k, v):
            out = ttt_attention(q, k, v, batch.doc, past_k, past_v, scale)
            past_k.append(k)
            past_v.append(v)
            return out

        hidden = eagle3.head_layer(params, cfg, embeds, hidden, cos, sin, attend)
        logits = eagle3.draft_logits(params, cfg, hidden)
        logits_all.append(logits)
        if feed_own:
            tokens = params.draft_to_target[jnp.argmax(logits, axis=-1)]
        else:
            tokens = shift(batch.tokens, s + 1)
    return jnp.stack(logits_all)


def target_draft_logits(target_lm_head_rows: jax.Array, final: jax.Array) -> jax.Array:
    """The target's logits over the draft vocabulary f32[B, T, Vd] from its final-normed states and
    its lm_head's draft-vocabulary columns f[D, Vd]."""
    return jnp.einsum("btd,dv->btv", final.astype(jnp.float32), target_lm_head_rows.astype(jnp.float32))


def step_valid(batch: Batch, s: int) -> jax.Array:
    """bool[B, T]: index i's step-s target (index i + s) is in the same sequence and counted."""
    same = (shift(batch.doc, s, -2) == batch.doc) & (batch.doc >= 0)
    return same & shift(batch.mask, s, False)


def ttt_loss(params, cfg, embed, lm_head_rows, batch: Batch, steps: int, decay: float = 1.0, noise=None):
    """(loss, metrics): speculators' kl_div loss summed over the steps, and per step the loss and
    the accuracy of the draft's argmax against the target's (over the draft vocabulary)."""
    logits = unroll(params, cfg, embed, batch, steps, noise=noise)
    target = target_draft_logits(lm_head_rows, batch.final)
    total = jnp.zeros((), jnp.float32)
    metrics = {}
    for s in range(steps):
        t = shift(target, s)
        mask = step_valid(batch, s).astype(jnp.float32)
        p_log = jax.nn.log_softmax(t, axis=-1)
        q_log = jax.nn.log_softmax(logits[s], axis=-1)
        kl = jnp.sum(jnp.exp(p_log) * (p_log - q_log), axis=-1)
        step_loss = jnp.sum(kl * mask) / (jnp.sum(mask) + 1e-5)
        total = total + decay**s * step_loss
        agree = (jnp.argmax(logits[s], -1) == jnp.argmax(t, -1)).astype(jnp.float32)
        metrics[f"loss_{s}"] = step_loss
        metrics[f"acc_{s}"] = jnp.sum(agree * mask) / (jnp.sum(mask) + 1e-5)
    metrics["loss"] = total
    return total, metrics


def acceptance_counts(params, cfg, embed, batch: Batch, k: int) -> tuple[jax.Array, jax.Array]:
    """Greedy drafting simulated at every counted index whose k targets all lie in its sequence:
    (accepted f32[k], starts f32[]), accepted[s] = chains whose drafts 0..s all equal the target's
    greedy tokens."""
    logits = unroll(params, cfg, embed, batch, k, feed_own=True)
    start = step_valid(batch, k - 1) & batch.mask
    alive = start
    accepted = []
    for s in range(k):
        draft = params.draft_to_target[jnp.argmax(logits[s], axis=-1)]
        alive = alive & (draft == shift(batch.greedy, s, -1))
        accepted.append(jnp.sum(alive.astype(jnp.float32)))
    return jnp.stack(accepted), jnp.sum(start.astype(jnp.float32))
