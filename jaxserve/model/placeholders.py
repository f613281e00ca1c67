"""Tokens still on the device: how a step takes the tokens the step before it sampled.

With overlapped scheduling (`async_scheduling`) step N+1 is packed and dispatched before step N's
samples reach the host. A sequence that sampled in step N therefore carries a placeholder in its
token list: a negative id naming the sample's slot in step N's output. The compiled step swaps
every placeholder in its inputs (tokens, penalty histories) for that slot of the previous step's
carried tokens, so sampled ids go from one step to the next on the device, never through the host.
The host writes the real id over the placeholder when it processes step N. The host side (the
encoding: `ragged.placeholder`, `ragged.is_placeholder`) lives in `jaxserve.model.ragged`, which has no jax.

Ids -1 and up keep their meanings (-1 pads a penalty history); placeholders are -2 and below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def carry_tokens(sampled: jax.Array, width: int) -> jax.Array:
    """i32[R, width]: a step's sampled tokens i32[R, L] (L <= width), padded to the one width every
    step variant takes, so any step can follow any other."""
    return jnp.zeros(sampled.shape[:1] + (width,), jnp.int32).at[:, : sampled.shape[1]].set(sampled)


def resolve(ids: jax.Array, carried: jax.Array) -> jax.Array:
    """`ids` i32[R, ...] with each placeholder replaced by its slot of `carried` i32[R, width] (the
    previous step's tokens of the same replica); every other id is kept."""
    width = carried.shape[-1]

    def one(ids, carried):  # one replica
        slot = jnp.clip(-2 - ids, 0, width - 1)
        return jnp.where(ids <= -2, carried[slot], ids)

    return jax.vmap(one)(ids, carried)
