"""N-gram (prompt lookup) proposals on the host (numpy, no jax): copy what followed an earlier occurrence
of the sequence's last n tokens, trying the longest n first."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens to propose after `tokens` (prompt + output so far); [] when nothing matches.

    For n from n_max down to n_min: find the most recent earlier occurrence of the last n tokens
    (not the suffix itself) and propose the tokens that followed it. The longest n wins: a longer
    match is more likely to continue the same way; among equal n the latest is taken, as it reflects
    the most recent context (a loop the model is in, the part of the prompt being copied). A match
    always yields k tokens: a copy reaching the end of the sequence repeats itself (a loop continues).

    Cost: one vectorised comparison over the sequence (positions holding the last token), then a
    few over the surviving candidates (~10-60 us for 100-2000 tokens; sliding windows took ~0.5 ms).
    """
    if k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    # Candidates i: arr[i] equals the last token and is followed by at least one token.
    candidates = np.flatnonzero(arr[: length - 1] == arr[length - 1])
    best = -1
    for n in range(1, min(n_max, length - 1) + 1):
        if n > 1:  # keep the candidates whose match extends one more token back
            candidates = candidates[candidates >= n - 1]
            candidates = candidates[arr[candidates - (n - 1)] == arr[length - n]]
        if candidates.size == 0:
            break
        if n >= n_min:
            best = int(candidates[-1])
    if best < 0:
        return []
    # Copy what followed the match; where the copy runs into the suffix itself (a match d tokens
    # before the end, as in a loop of period d) it continues with what it just copied, LZ77-style.
    period = length - 1 - best
    follow = arr[best + 1 :].tolist()
    return [follow[j % period] for j in range(k)]


class TokenBuffer:
    """A sequence's tokens (prompt, then output) as a growing numpy array: tokens are only ever
    appended, so each step copies just the new ones instead of converting the whole list."""

    def __init__(self) -> None:
        self._array = np.empty(0, np.int64)
        self._size = 0

    def view(self, prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:
        total = len(prompt) + len(output)
        if total > len(self._array):
            grown = np.empty(max(2 * len(self._array), total + 64), np.int64)
            grown[: self._size] = self._array[: self._size]
            self._array = grown
        if self._size < len(prompt):
            self._array[self._size : len(prompt)] = prompt[self._size :]
            self._size = len(prompt)
        if self._size < total:
            self._array[self._size : total] = output[self._size - len(prompt) :]
            self._size = total
        return self._array[:total]
