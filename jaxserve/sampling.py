"""On-device batched sampling: every row has its own temperature, top-k, top-p and PRNG stream.

Parameters are arrays, not Python values, so one compiled step serves any mix of requests. Random
numbers are keyed by (request seed, output index): a request's tokens do not depend on what else is
in the batch.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class SamplingTensors:
    """Per-row sampling parameters (padding rows: temperature 0)."""

    temperature: jax.Array  # f32[B]  0 = greedy
    top_k: jax.Array  # i32[B]  0 = no limit
    top_p: jax.Array  # f32[B]  1 = no limit
    seed: jax.Array  # u32[B]
    step: jax.Array  # i32[B]  index of the token being sampled within its request's output


def _filtered_logits(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Temperature-scaled logits with everything outside top-k / top-p set to -inf."""
    scaled = logits / jnp.maximum(st.temperature, 1e-6)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # f32[B, V]
    vocab = logits.shape[-1]
    k = jnp.where(st.top_k > 0, jnp.minimum(st.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # f32[B, 1]
    # top-p: keep the smallest prefix of sorted tokens whose mass reaches p (the first always kept).
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < st.top_p[:, None]
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Tokens i32[B] from logits f32[B, V]. The sort is skipped when every row is greedy."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(st.seed, st.step)
        drawn = jax.vmap(jax.random.categorical)(keys, _filtered_logits(logits, st)).astype(jnp.int32)
        return jnp.where(st.temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(st.temperature > 0), draw, lambda _: greedy, None)
