"""The EAGLE-3 head: one decoder layer that drafts from the target's own hidden states.

Where a separate draft model reads only tokens, the head reads, at each position p, the target's
states entering three of its layers (`aux_layers`, HF `hidden_states` indices) fused by `fc` into one
vector g_p, beside the embedding of the token at p + 1, and predicts the token at p + 2. Its one layer
is a Llama layer whose q/k/v take both halves: [input_layernorm(embedding), hidden_norm(hidden)]
(width 2D); the residual is the hidden (normed first with `norm_before_residual`). Its output before
the final norm is the hidden of the next draft step, where no target state exists yet. Logits cover a
reduced draft vocabulary mapped back to target ids by `draft_to_target` (speculators' `d2t` offsets
added to the draft ids).

The same functions run in serving (`spec_decode/eagle3_draft.py`: paged attention over the head's
own one-layer KV cache, which shares the target's page ids) and in training (`scripts/
train_eagle3.py`: dense attention with the training-time-test mask): `head_layer` takes the
attention as a function, as `llama.decoder_layer` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.layers import apply_rope, rms_norm, swiglu
from jaxserve.model.weights import LayerParams


# vLLM's default aux layers for a target of L layers when a head names none.
def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """A head's shape (hashable: a static argument of the compiled steps)."""

    layer: ModelConfig  # the head's one decoder layer (num_layers 1; vocab_size: the target's)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    norm_before_residual: bool = False

    @classmethod
    def for_target(
        cls, target: ModelConfig, draft_vocab_size: int, aux_layers: tuple[int, ...] | None = None
    ) -> Eagle3Config:
        """A new head for `target` (training): its layer shaped like one of the target's."""
        layer = dataclasses.replace(target, num_layers=1, layer_types=(), num_experts=0, dense_layers=())
        return cls(
            layer=layer,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target.hidden_size,
            aux_layers=tuple(aux_layers or default_aux_layers(target.num_layers)),
        )

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


@flax.struct.dataclass
class Eagle3Params:
    fc: jax.Array  # f[len(aux_layers) * Dt, D]
    hidden_norm: jax.Array  # f[D]
    layer: LayerParams  # one layer, unstacked: wq/wk/wv f[2D, ...], attn_norm = input_layernorm
    norm: jax.Array  # f[D]
    lm_head: jax.Array  # f[D, Vd]
    draft_to_target: jax.Array  # i32[Vd]: the target id of each draft id
    embed: jax.Array | None = None  # f[V, D]; None: the target's embedding is shared


def init_params(cfg: Eagle3Config, key: jax.Array, dtype, draft_to_target: jax.Array) -> Eagle3Params:
    """A new head: normal(0, 0.02) matrices and unit norms (a training start)."""
    D, Dt, F = cfg.hidden_size, cfg.target_hidden_size, cfg.layer.intermediate_size
    N, K, H = cfg.layer.num_heads, cfg.layer.num_kv_heads, cfg.layer.head_dim
    shapes = {
        "fc": (len(cfg.aux_layers) * Dt, D),
        "wq": (2 * D, N * H),
        "wk": (2 * D, K * H),
        "wv": (2 * D, K * H),
        "wo": (N * H, D),
        "w_gate": (D, F),
        "w_up": (D, F),
        "w_down": (F, D),
        "lm_head": (D, cfg.draft_vocab_size),
    }
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    w = {name: (0.02 * jax.random.normal(keys[name], shape)).astype(dtype) for name, shape in shapes.items()}
    ones = jnp.ones((D,), dtype)
    layer = LayerParams(
        attn_norm=ones,
        wq=w["wq"],
        wk=w["wk"],
        wv=w["wv"],
        wo=w["wo"],
        mlp_norm=ones,
        w_gate=w["w_gate"],
        w_up=w["w_up"],
        w_down=w["w_down"],
    )
    return Eagle3Params(
        fc=w["fc"],
        hidden_norm=ones,
        layer=layer,
        norm=ones,
        lm_head=w["lm_head"],
        draft_to_target=jnp.asarray(draft_to_target, jnp.int32),
    )


def fuse(params: Eagle3Params, aux: jax.Array) -> jax.Array:
    """g f[..., D]: the aux layers' states concatenated in `aux_layers` order, f[..., 3 * Dt], fused."""
    return jnp.matmul(aux.astype(params.fc.dtype), params.fc)


def head_layer(
    params: Eagle3Params,
    cfg: Eagle3Config,
    embeds: jax.Array,  # f[B, T, D]
    hidden: jax.Array,  # f[B, T, D]: g (fused target states) or the previous draft step's output
    cos: jax.Array,  # RoPE tables of the positions, `layers.rope_cos_sin(positions, cfg.layer)`
    sin: jax.Array,
    attend_fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
) -> jax.Array:
    """The head's pre-norm output f[B, T, D] (the next draft step's hidden; `draft_logits` reads it).
    `attend_fn(q, k, v) -> f[B, T, N, H]`: dense and masked in training, the paged cache in serving."""
    lc, lp = cfg.layer, params.layer
    B, T, _ = embeds.shape
    N, K, H = lc.num_heads, lc.num_kv_heads, lc.head_dim
    e = rms_norm(embeds, lp.attn_norm, lc.rms_norm_eps)
    h = rms_norm(hidden, params.hidden_norm, lc.rms_norm_eps)
    residual = h if cfg.norm_before_residual else hidden
    x = jnp.concatenate([e, h.astype(e.dtype)], axis=-1)  # f[B, T, 2D]
    q = apply_rope((x @ lp.wq).reshape(B, T, N, H), cos, sin)
    k = apply_rope((x @ lp.wk).reshape(B, T, K, H), cos, sin)
    v = (x @ lp.wv).reshape(B, T, K, H)
    attn = attend_fn(q, k, v).reshape(B, T, N * H)
    x = residual.astype(attn.dtype) + attn @ lp.wo
    return x + swiglu(rms_norm(x, lp.mlp_norm, lc.rms_norm_eps), lp.w_gate, lp.w_up, lp.w_down)


def draft_logits(params: Eagle3Params, cfg: Eagle3Config, prenorm: jax.Array) -> jax.Array:
    """f32[..., Vd] over the draft vocabulary."""
    x = rms_norm(prenorm, params.norm, cfg.layer.rms_norm_eps)
    return jnp.einsum("...d,dv->...v", x, params.lm_head, preferred_element_type=jnp.float32)


def target_logits(params: Eagle3Params, logits: jax.Array, vocab_size: int) -> jax.Array:
    """Draft-vocabulary logits f32[..., Vd] laid over the target's vocabulary f32[..., V]: -inf at
    every id outside the draft vocabulary, so the head never proposes one (and its probability there
    is zero, which rejection sampling needs)."""
    full = jnp.full(logits.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., params.draft_to_target].set(logits.astype(jnp.float32))
