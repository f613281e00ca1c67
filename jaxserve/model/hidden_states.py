"""Hidden states as a step's output: which ones a ragged step returns beside (or instead of) logits.

Two users need the model's states rather than its next-token distribution, and both read them from
the one cached forward (`llama.forward_ragged`) so that they share its pages, buckets and kernels:

* EAGLE-3 drafting fuses three of the target's layers' hidden states at the tokens of the rows that
  speculate (`HiddenStates(layers=(2, L // 2, L - 3))`, at `state_index`).
* Embeddings pool the final-normed state of each prompt: at its last token (Qwen3-Embedding), its
  first (CLS), or the mean over its tokens, a prompt longer than a step summed chunk by chunk
  (`row_sums`, divided by the count on the host).

`HiddenStates` is static (hashable: a static argument of the compiled step, so part of its
executable's key; engines that never ask compile nothing new). The chosen token positions are data:
`state_index` i32[M], indices into the step's flat token axis, like `RaggedBatch.logit_index`.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class HiddenStates:
    """Which hidden states a ragged step returns (static).

    `layers`: HF's `hidden_states[i]` for each i, the residual stream entering layer i (0: the scaled
    embeddings; i < num_layers), at `state_index`, the convention vLLM's EAGLE-3 aux layers follow.
    `final`: the final-normed state (what `lm_head` reads; HF's `last_hidden_state`) at `state_index`.
    `row_sums`: the final-normed state summed over each row's tokens in this step, in float32.
    `logits`: the logits at `logit_index` as well (False: the vocabulary matmul is skipped)."""

    layers: tuple[int, ...] = ()
    final: bool = False
    row_sums: bool = False
    logits: bool = True

    def __post_init__(self):
        if any(i < 0 for i in self.layers) or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers must be distinct non-negative layer indices, got {self.layers}")
        if not (self.layers or self.final or self.row_sums or self.logits):
            raise ValueError("HiddenStates asks for nothing: set layers, final, row_sums or logits")

    @property
    def needs_index(self) -> bool:
        """Whether the step takes `state_index` (states at chosen tokens)."""
        return bool(self.layers) or self.final


@flax.struct.dataclass
class HiddenOutput:
    """What a step with `HiddenStates` returns (per replica; the ragged step adds a leading R).
    Fields not asked for are None."""

    logits: jax.Array | None  # f32[L, V] at logit_index
    layers: jax.Array | None  # f[len(layers), M, D] at state_index, in `HiddenStates.layers` order
    final: jax.Array | None  # f[M, D] final-normed, at state_index
    row_sums: jax.Array | None  # f32[S, D] final-normed, summed over each row's tokens (padding rows 0)


def check_layers(states: HiddenStates, num_layers: int) -> None:
    """Trace-time validation against the model's depth."""
    bad = [i for i in states.layers if i >= num_layers]
    if bad:
        raise ValueError(f"hidden-state layers {bad} past the model's {num_layers} layers (0..{num_layers - 1})")


def sum_rows(x: jax.Array, token_row: jax.Array, num_rows: int) -> jax.Array:
    """x f[N, D] summed per row (`RaggedBatch.token_row`; padding tokens name row S, dropped) in
    float32: f32[S, D]."""
    return jax.ops.segment_sum(x.astype(jnp.float32), token_row, num_segments=num_rows + 1)[:num_rows]
