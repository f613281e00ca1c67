"""The flat ragged step layout, packed on the host (numpy only: no jax, so host code can own it).

One step of one replica is a flat axis of `N` tokens (prompt chunks, decodes and verifications side
by side, each row's tokens contiguous, rows in order) plus per-row metadata for `S` rows. The
device side (`kv_cache.RaggedBatch`, `model.llama.forward_ragged`) takes exactly these arrays.

Static per compiled step (shapes): `N`, a token-budget bucket (powers of two up to
`max_num_batched_tokens`, so a step costs what its real tokens round up to); `S` (rows) and `P`
(pages per row) fixed per engine; `L` (logits returned) fixed per engine too (rows times the widest
verification). Everything else is data, so one executable serves every mix of rows that fits.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

PAD_SLOT = -1  # slot of a padding token: out of range, so its K/V write is dropped
PADDING_PAGE = 0  # page-table entries past a row's pages point at the padding page (never owned)


def placeholder(slot: int) -> int:
    """The token id standing for sample `slot` (its index among its replica's samples) of the step in
    flight, until the host has it: the compiled step takes the real id from the previous step's
    samples on the device (jaxserve.placeholders). Real ids are >= 0 and -1 pads histories."""
    return -2 - slot


def is_placeholder(token: int) -> bool:
    return token <= -2


@dataclasses.dataclass(frozen=True)
class RaggedRow:
    """One row of a step: `tokens` to run from position `start` (tokens already cached), its page
    table, and how many of its last tokens return logits: 1 for a row that samples (a decode, the
    last chunk of a prompt), k + 1 for a verification of k drafts, 0 for a prompt chunk that does
    not end its prompt."""

    tokens: Sequence[int]
    start: int
    pages: Sequence[int]
    num_logits: int = 1


@dataclasses.dataclass(frozen=True)
class RaggedArrays:
    """Host arrays of one replica's ragged step (field meanings: `kv_cache.RaggedBatch`)."""

    tokens: np.ndarray  # i32[N]
    positions: np.ndarray  # i32[N]
    slots: np.ndarray  # i32[N]
    token_row: np.ndarray  # i32[N]
    query_start: np.ndarray  # i32[S+1]
    context_lens: np.ndarray  # i32[S]
    page_table: np.ndarray  # i32[S, P]
    logit_index: np.ndarray  # i32[L]


def pack_ragged(
    rows: Sequence[RaggedRow], *, page_size: int, num_tokens: int, num_rows: int, max_pages: int, num_logits: int,
) -> RaggedArrays:
    """Pack rows into a step padded to `num_tokens` (N), `num_rows` (S), `max_pages` (P) and
    `num_logits` (L). Padding tokens sit after the last row: token 0 at position 0, slot PAD_SLOT,
    row S (no row). Padding rows have no tokens, context 0 and the padding page; padding logits
    point at token 0 and are ignored by the caller. Row r's logits come in row order, its last
    `num_logits` tokens oldest first."""
    n_real = sum(len(r.tokens) for r in rows)
    n_logits = sum(r.num_logits for r in rows)
    if len(rows) > num_rows or n_real > num_tokens or n_logits > num_logits:
        raise ValueError(f"{len(rows)} rows, {n_real} tokens, {n_logits} logits do not fit a step of "
                         f"{num_rows} rows, {num_tokens} tokens, {num_logits} logits")
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, PAD_SLOT, np.int32)
    token_row = np.full(num_tokens, num_rows, np.int32)
    query_start = np.full(num_rows + 1, n_real, np.int32)
    context_lens = np.zeros(num_rows, np.int32)
    page_table = np.full((num_rows, max_pages), PADDING_PAGE, np.int32)
    logit_index = np.zeros(num_logits, np.int32)
    t = li = 0
    for r, row in enumerate(rows):
        n, end = len(row.tokens), row.start + len(row.tokens)
        if not 0 <= row.num_logits <= n:
            raise ValueError(f"row {r}: num_logits {row.num_logits} outside 0..{n} (its tokens)")
        if len(row.pages) > max_pages or -(-end // page_size) > len(row.pages):
            raise ValueError(f"row {r}: {end} tokens need {-(-end // page_size)} pages; it has "
                             f"{len(row.pages)}, a step holds {max_pages}")
        pages = np.asarray(row.pages, np.int32)
        pos = np.arange(row.start, end, dtype=np.int32)
        tokens[t: t + n] = row.tokens
        positions[t: t + n] = pos
        slots[t: t + n] = pages[pos // page_size] * page_size + pos % page_size
        token_row[t: t + n] = r
        query_start[r] = t
        context_lens[r] = end
        page_table[r, : len(pages)] = pages
        logit_index[li: li + row.num_logits] = np.arange(t + n - row.num_logits, t + n)
        t, li = t + n, li + row.num_logits
    return RaggedArrays(tokens, positions, slots, token_row, query_start, context_lens, page_table, logit_index)
