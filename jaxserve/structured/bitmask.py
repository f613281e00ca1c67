"""Host-side token bitmasks: int32 words, token t allowed iff bit t % 32 of word t // 32 is set (llguidance's and xgrammar's layout)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["bitmask_words", "allocate_bitmask", "set_only", "unpack_bitmask", "allowed_tokens"]


def bitmask_words(vocab_size: int) -> int:
    """W = ceil(V / 32): the words of one row's mask."""
    return (int(vocab_size) + 31) // 32


def allocate_bitmask(batch: int, vocab_size: int) -> np.ndarray:
    """i32[batch, W], all ones: every token allowed (what an unconstrained row carries)."""
    return np.full((int(batch), bitmask_words(vocab_size)), -1, dtype=np.int32)


def set_only(row: np.ndarray, token_ids: Sequence[int]) -> None:
    """Overwrite one row (i32[W]) so that only `token_ids` are allowed."""
    row[:] = 0
    words = row.view(np.uint32)
    for t in token_ids:
        words[t >> 5] |= np.uint32(1 << (t & 31))


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool[..., V] from i32[..., W]: the reference the device function is tested against."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def allowed_tokens(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """i64[k]: the allowed ids of one row (i32[W])."""
    return np.flatnonzero(unpack_bitmask(row, vocab_size))
