"""LoRA on the device: every resident adapter of a layer side by side, and the update of a ragged
step's tokens, each under its own row's adapter.

Per adaptable module a layer holds `a` f[in, M * R] and `b` f[M * R, out]: device slot m's A in
columns m*R .. m*R + r and its B (the adapter's scaling folded in) in the same rows of `b`, zeros
past the adapter's rank r <= R. A token of slot m (`RaggedBatch.row_lora` of its row; -1 for the
base model) updates its output by x A_m B_m, computed for all tokens together as

    ((x @ a) * columns) @ b        columns f[N, M * R]: 1 on the token's slot's R columns, else 0

two dense matmuls whatever the mix of adapters: each resident adapter is read once a step (the
fewest bytes when the batch uses them all: what bounds a decode step), no gather, no sort, and a
base row is the same work as an adapted one. The formulations measured against each other are in
docs/BENCHMARKS.md ("LoRA: how the rows' low-rank updates are computed").
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class LoRAModule:
    """One module's resident adapters: a f[..., in, M * R], b f[..., M * R, out] (a leading layer
    axis when the layers are stacked)."""

    a: jax.Array
    b: jax.Array


@flax.struct.dataclass
class LayerLoRA:
    """A layer's resident adapters, per module (None: a module the model does not have, e.g. the
    dense MLP's of a mixture of experts). `slots` (M) and `rank` (R) are static."""

    q: LoRAModule | None = None
    k: LoRAModule | None = None
    v: LoRAModule | None = None
    o: LoRAModule | None = None
    gate: LoRAModule | None = None
    up: LoRAModule | None = None
    down: LoRAModule | None = None
    slots: int = flax.struct.field(pytree_node=False, default=1)
    rank: int = flax.struct.field(pytree_node=False, default=1)


def token_columns(row_lora: jax.Array, token_row: jax.Array, slots: int, rank: int, dtype) -> jax.Array:
    """f[N, M * R]: 1 where the column belongs to the token's adapter slot. `row_lora` i32[S] is each
    row's slot (-1: the base model); `token_row` i32[N] each token's row (S for padding tokens,
    which get no adapter)."""
    num_rows = row_lora.shape[0]
    slot = jnp.where(token_row < num_rows, row_lora[jnp.minimum(token_row, num_rows - 1)], -1)  # i32[N]
    column_slot = jnp.arange(slots * rank, dtype=jnp.int32) // rank  # i32[M * R]
    return (slot[:, None] == column_slot[None, :]).astype(dtype)


def delta(x: jax.Array, module: LoRAModule, columns: jax.Array) -> jax.Array:
    """The low-rank update of x f[..., N, in] (each token's own adapter): f[..., N, out]."""
    xa = jnp.matmul(x, module.a.astype(x.dtype)) * columns.astype(x.dtype)
    return jnp.matmul(xa, module.b.astype(x.dtype))


def apply(y: jax.Array, x: jax.Array, lora: LayerLoRA | None, name: str, columns: jax.Array | None) -> jax.Array:
    """y (the base module's output for x) plus the update of module `name`, if the layer adapts it."""
    module = None if lora is None or columns is None else getattr(lora, name)
    return y if module is None else y + delta(x, module, columns)
