"""GrammarMatcher: one sequence's grammar state; its next-token bitmask, advance, rollback, copy (n > 1 forks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import llguidance
import numpy as np

from jaxserve.structured.bitmask import bitmask_words, set_only

if TYPE_CHECKING:
    from jaxserve.structured.compiler import CompiledGrammar

__all__ = ["GrammarMatcher", "fill_bitmasks"]


class GrammarMatcher:
    """The state of one sequence under one compiled grammar (host only; no jax).

    Per decode step: `fill_bitmask(row)` for the token about to be sampled, then `advance(token)`
    with the token that was sampled. A finished grammar (`is_finished`) allows only EOS; so does a
    matcher in error (a token it forbade was forced on it), so every row can always end.

    Preemption by recompute needs nothing: the matcher already holds the state after the
    committed tokens, which recompute reproduces. `rollback(k)` un-consumes the last k tokens
    (rejected speculative tokens; up to the whole output), `reset()` returns to the start.
    """

    __slots__ = ("compiled", "_m", "_num_tokens")

    def __init__(self, compiled: "CompiledGrammar", ll_matcher: llguidance.LLMatcher, num_tokens: int = 0):
        self.compiled = compiled
        self._m = ll_matcher
        self._num_tokens = num_tokens

    # -- state -----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.compiled.vocab_size

    @property
    def bitmask_words(self) -> int:
        return bitmask_words(self.compiled.vocab_size)

    @property
    def num_tokens(self) -> int:
        """Tokens consumed since the start (what rollback can undo)."""
        return self._num_tokens

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows no more text: only EOS may follow."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed now). An output cut by max_tokens
        while this is False is incomplete: report finish_reason "length", never valid output."""
        return self._m.is_accepting()

    @property
    def is_error(self) -> bool:
        return self._m.is_error()

    @property
    def error(self) -> str:
        return self._m.get_error()

    # -- per step --------------------------------------------------------------------------------

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the next token's mask into `row` (i32[W], C-contiguous), e.g. one row of the step's
        [max_rows, W] array. Costs one mask computation (see docs/ARCHITECTURE.md for measured times)."""
        _check_row(row, self.bitmask_words)
        if self._m.is_error():
            set_only(row, self.compiled.eos_token_ids)
            return
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def allowed_bitmask(self) -> np.ndarray:
        """i32[W]: a new array with the next token's mask."""
        row = np.empty(self.bitmask_words, dtype=np.int32)
        self.fill_bitmask(row)
        return row

    def advance(self, token: int) -> bool:
        """Consume the sampled token. False when the grammar forbids it: the matcher is then in error
        for good (`error` says why) and allows only EOS; with masks applied this cannot happen."""
        ok = self._m.consume_token(int(token))
        if ok:
            self._num_tokens += 1
        return ok

    def advance_many(self, tokens: Sequence[int]) -> bool:
        """Consume several tokens (e.g. accepted speculative tokens); False as for `advance`."""
        tokens = [int(t) for t in tokens]
        ok = self._m.consume_tokens(tokens)
        if ok:
            self._num_tokens += len(tokens)
        return ok

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar would accept, without consuming any (for drafts)."""
        return self._m.validate_tokens([int(t) for t in tokens])

    # -- preemption, speculation, forks ---------------------------------------------------------

    def rollback(self, num_tokens: int) -> None:
        """Un-consume the last `num_tokens` tokens."""
        if not 0 <= num_tokens <= self._num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {self._num_tokens} were consumed")
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._m.get_error()}")
        self._num_tokens -= num_tokens

    def reset(self) -> None:
        """Back to the state before the first token (and out of any error)."""
        self._m = self.compiled.new_ll_matcher()
        self._num_tokens = 0

    def copy(self) -> "GrammarMatcher":
        """An independent matcher in the same state (a fork for n > 1 or beam-like branching)."""
        return GrammarMatcher(self.compiled, self._m.deep_copy(), self._num_tokens)

    def ll_matcher(self) -> llguidance.LLMatcher | None:
        """The llguidance matcher `fill_bitmasks` computes this row's mask with (None: the matcher
        fills its row itself, e.g. a reasoning-gated one before its marker)."""
        return self._m

    def __repr__(self) -> str:
        state = "error" if self.is_error else "finished" if self.is_finished else "running"
        return f"GrammarMatcher({self.compiled.spec.kind}, tokens={self._num_tokens}, {state})"


def fill_bitmasks(
    rows: Sequence[tuple[GrammarMatcher, int]],
    out: np.ndarray,  # i32[max_rows, W]; rows not listed are left as they are (all ones: unconstrained)
    executor: llguidance.LLExecutor | None = None,
) -> None:
    """Masks for many sequences at once: (matcher, row index) pairs into `out`.

    With an `llguidance.LLExecutor` the masks are computed on its threads in parallel with the GIL
    released; without one, one after another on the calling thread.
    """
    if not rows:
        return
    if out.dtype != np.int32 or out.ndim != 2 or not out.flags["C_CONTIGUOUS"]:
        raise ValueError(f"out must be a C-contiguous int32 [rows, W] array, got {out.dtype} {out.shape}")
    w = out.shape[1]
    for m, i in rows:
        if m.bitmask_words != w:
            raise ValueError(f"a matcher's mask has {m.bitmask_words} words; out has {w}")
        if not 0 <= i < out.shape[0]:
            raise ValueError(f"row {i} is outside out's {out.shape[0]} rows")
    computed = []
    for m, i in rows:
        ll = m.ll_matcher()
        if ll is None or executor is None:
            m.fill_bitmask(out[i])
        else:
            computed.append((m, ll, i))
    if not computed:
        return
    executor.unsafe_compute_mask_ptr([(ll, i) for _, ll, i in computed], out.ctypes.data, w * 4, out.shape[0])
    for m, ll, i in computed:
        if ll.is_error():
            set_only(out[i], m.compiled.eos_token_ids)


def _check_row(row: np.ndarray, words: int) -> None:
    if row.dtype != np.int32 or row.shape != (words,) or not row.flags["C_CONTIGUOUS"]:
        raise ValueError(f"a mask row must be a C-contiguous int32 [{words}] array, got {row.dtype} {row.shape}")
