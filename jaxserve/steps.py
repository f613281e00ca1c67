"""The jit-compiled steps: the public step-level API for research code.

`prefill` / `decode` take rows as a rectangle (`StepBatch`, [R, B, T] tokens), the easy form to build
by hand; they lay the rows out as a `RaggedBatch` on the device and run the engine's step body
(`jaxserve.model.ragged_step`), so research code measures the forward and the attention that serve.
`ragged` is that step body itself, over a `RaggedBatch` you lay out. All take `(params, cache, batch)`
and return `(logits, cache)`; the cache is donated (updated in place) unless you call a `*_nodonate`
variant. The model config, the `StepOptions` (`jaxserve.model.step_options`) and `all_logits` are
static, so one compilation serves every batch of a shape.

`all_logits` belongs to the rectangle steps only: with it `prefill` returns the logits at every token
of every row (f32[R, B, T, V]) instead of at each row's last. The ragged step needs no flag: it
returns the logits at its batch's `logit_index`, so list every token there for all of them.
The engine does not use this module (its executables are `jaxserve.runner`'s).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import KVCache, RaggedBatch, StepBatch
from jaxserve.model.ragged import PAD_SLOT
from jaxserve.model.ragged_step import ragged_step
from jaxserve.model.step_options import StepOptions
from jaxserve.model.weights import Params

__all__ = [
    "StepOptions",
    "decode",
    "decode_nodonate",
    "model_step",
    "prefill",
    "prefill_nodonate",
    "ragged",
    "ragged_nodonate",
    "rows_as_ragged",
]


def rows_as_ragged(batch: StepBatch, page_size: int, all_logits: bool) -> RaggedBatch:
    """One replica's rectangle rows (tokens i32[B, T], the rest i32[B] / i32[B, P]) in the ragged
    step's layout, on the device: each row's num_new tokens packed in row order (N = B * T, padding
    tokens after the last row), one row slot per row (S = B) and the logits at each row's last
    token (L = B), or at every token of every row with `all_logits` (L = B * T; tokens past a row's
    num_new repeat its last). Rows with num_new == 0 run as padding rows: no tokens, context 0.
    Pure array arithmetic on static shapes, so the rectangle steps stay one compilation per shape."""
    B, T = batch.tokens.shape
    num_new = jnp.clip(batch.num_new, 0, T)  # i32[B]
    query_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(num_new, dtype=jnp.int32)])  # i32[B+1]
    flat = jnp.arange(B * T, dtype=jnp.int32)
    real = flat < query_start[-1]  # bool[N]
    token_row = jnp.searchsorted(query_start[1:], flat, side="right").astype(jnp.int32)  # i32[N]; B past the rows
    row = jnp.minimum(token_row, B - 1)
    offset = flat - query_start[row]  # i32[N]  index of each token within its row
    positions = jnp.where(real, batch.start_pos[row] + offset, 0)
    page = batch.page_table.at[row, positions // page_size].get(mode="clip")
    last = query_start[:-1] + jnp.maximum(num_new - 1, 0)  # i32[B]
    if all_logits:
        last = jnp.minimum(query_start[:-1, None] + jnp.arange(T, dtype=jnp.int32), last[:, None])
    return RaggedBatch(
        tokens=jnp.where(real, batch.tokens.at[row, offset].get(mode="clip"), 0),
        positions=positions,
        slots=jnp.where(real, page * page_size + positions % page_size, PAD_SLOT),
        token_row=jnp.where(real, token_row, B),
        query_start=query_start,
        context_lens=jnp.where(num_new > 0, batch.start_pos + num_new, 0),
        page_table=batch.page_table,
        logit_index=jnp.minimum(last.reshape(-1), B * T - 1),
    )


def model_step(
    params: Params,
    cache: KVCache,
    batch: StepBatch,
    cfg: ModelConfig,
    options: StepOptions = StepOptions(),
    all_logits: bool = False,
) -> tuple[jax.Array, KVCache]:
    """The rectangle steps' body: `batch`'s rows laid out by `rows_as_ragged`, then `ragged_step`.
    Returns logits f32[R, B, V] at each row's last token (f32[R, B, T, V] with `all_logits`) and the
    updated cache. Padding rows (num_new == 0) write nothing and their logits are meaningless."""
    R, B, T = batch.tokens.shape
    layout = functools.partial(rows_as_ragged, page_size=cache.page_size, all_logits=all_logits)
    logits, cache = ragged_step(params, cache, jax.vmap(layout)(batch), cfg, options)
    return (logits.reshape(R, B, T, -1) if all_logits else logits), cache


def _decode(params, cache, batch, cfg, options=StepOptions(), all_logits=False):
    if batch.tokens.shape[-1] != 1:
        raise ValueError(f"decode takes one token per sequence; got tokens of shape {batch.tokens.shape}")
    return model_step(params, cache, batch, cfg, options, all_logits)


_STATIC = ("cfg", "options")
prefill = jax.jit(model_step, static_argnames=_STATIC + ("all_logits",), donate_argnames=("cache",))
decode = jax.jit(_decode, static_argnames=_STATIC + ("all_logits",), donate_argnames=("cache",))
prefill_nodonate = jax.jit(model_step, static_argnames=_STATIC + ("all_logits",))
decode_nodonate = jax.jit(_decode, static_argnames=_STATIC + ("all_logits",))
ragged = jax.jit(ragged_step, static_argnames=_STATIC, donate_argnames=("cache",))
ragged_nodonate = jax.jit(ragged_step, static_argnames=_STATIC)
