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
    samples on the device (jaxserve.model.placeholders). Real ids are >= 0 and -1 pads histories."""
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


def row_lora_slots(slots: Sequence[int], num_rows: int) -> np.ndarray:
    """`RaggedBatch.row_lora` of a step's rows: i32[S], each row's LoRA adapter slot, -1 for the base
    model and for padding rows."""
    out = np.full(num_rows, -1, np.int32)
    out[: len(slots)] = slots
    return out


LOOP_MAX_ROWS = 8  # up to this many rows a loop over rows packs fastest; beyond, whole-array NumPy


def pack_ragged(
    rows: Sequence[RaggedRow],
    *,
    page_size: int,
    num_tokens: int,
    num_rows: int,
    max_pages: int,
    num_logits: int,
) -> RaggedArrays:
    """Pack rows into a step padded to `num_tokens` (N), `num_rows` (S), `max_pages` (P) and
    `num_logits` (L). Padding tokens sit after the last row: token 0 at position 0, slot PAD_SLOT,
    row S (no row). Padding rows have no tokens, context 0 and the padding page; padding logits
    point at token 0 and are ignored by the caller. Row r's logits come in row order, its last
    `num_logits` tokens oldest first.

    The host packs every step, so this is timed: a loop over rows costs ~6 us a row and whole-array
    NumPy ~30 us a step plus ~2 us a row (measured: 1 row 10 vs 32 us, 64 rows 374 vs 139 us), so
    few rows take the loop and many the arrays; the two agree exactly (tests/model/test_ragged_forward.py)."""
    pack = _pack_by_row if len(rows) <= LOOP_MAX_ROWS else _pack_by_array
    return pack(
        rows, page_size=page_size, num_tokens=num_tokens, num_rows=num_rows, max_pages=max_pages, num_logits=num_logits
    )


def _pack_by_row(
    rows: Sequence[RaggedRow],
    *,
    page_size: int,
    num_tokens: int,
    num_rows: int,
    max_pages: int,
    num_logits: int,
) -> RaggedArrays:
    """pack_ragged, one row at a time."""
    n_real = sum(len(r.tokens) for r in rows)
    n_logits = sum(r.num_logits for r in rows)
    if len(rows) > num_rows or n_real > num_tokens or n_logits > num_logits:
        raise ValueError(
            f"{len(rows)} rows, {n_real} tokens, {n_logits} logits do not fit a step of "
            f"{num_rows} rows, {num_tokens} tokens, {num_logits} logits"
        )
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
            raise ValueError(
                f"row {r}: {end} tokens need {-(-end // page_size)} pages; it has "
                f"{len(row.pages)}, a step holds {max_pages}"
            )
        pages = np.asarray(row.pages, np.int32)
        pos = np.arange(row.start, end, dtype=np.int32)
        tokens[t : t + n] = row.tokens
        positions[t : t + n] = pos
        slots[t : t + n] = pages[pos // page_size] * page_size + pos % page_size
        token_row[t : t + n] = r
        query_start[r] = t
        context_lens[r] = end
        page_table[r, : len(pages)] = pages
        logit_index[li : li + row.num_logits] = np.arange(t + n - row.num_logits, t + n)
        t, li = t + n, li + row.num_logits
    return RaggedArrays(tokens, positions, slots, token_row, query_start, context_lens, page_table, logit_index)


def _pack_by_array(
    rows: Sequence[RaggedRow],
    *,
    page_size: int,
    num_tokens: int,
    num_rows: int,
    max_pages: int,
    num_logits: int,
) -> RaggedArrays:
    """pack_ragged as whole-array NumPy work plus one pass over the rows' tokens and pages."""
    count = len(rows)
    lens = np.fromiter((len(r.tokens) for r in rows), np.int64, count)
    starts = np.fromiter((r.start for r in rows), np.int64, count)
    logits_per_row = np.fromiter((r.num_logits for r in rows), np.int64, count)
    pages_per_row = np.fromiter((len(r.pages) for r in rows), np.int64, count)
    n_real, n_logits = int(lens.sum()), int(logits_per_row.sum())
    if count > num_rows or n_real > num_tokens or n_logits > num_logits:
        raise ValueError(
            f"{count} rows, {n_real} tokens, {n_logits} logits do not fit a step of "
            f"{num_rows} rows, {num_tokens} tokens, {num_logits} logits"
        )
    ends = starts + lens
    bad = np.flatnonzero((logits_per_row < 0) | (logits_per_row > lens))
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"row {r}: num_logits {rows[r].num_logits} outside 0..{int(lens[r])} (its tokens)")
    needed = -(-ends // page_size)
    bad = np.flatnonzero((pages_per_row > max_pages) | (needed > pages_per_row))
    if bad.size:
        r = int(bad[0])
        raise ValueError(
            f"row {r}: {int(ends[r])} tokens need {int(needed[r])} pages; it has "
            f"{int(pages_per_row[r])}, a step holds {max_pages}"
        )

    page_table = np.full((num_rows, max_pages), PADDING_PAGE, np.int32)
    page_rows = np.repeat(np.arange(count), pages_per_row)
    page_cols = np.arange(page_rows.size) - np.repeat(np.cumsum(pages_per_row) - pages_per_row, pages_per_row)
    if count:  # a list converts id by id; an int32 array (BlockManager.page_ids) is read as it is
        page_table[page_rows, page_cols] = np.concatenate([np.asarray(r.pages, np.int32) for r in rows])

    first = np.cumsum(lens) - lens  # each row's first token on the flat axis
    row_of = np.repeat(np.arange(count), lens)
    pos = starts[row_of] + np.arange(n_real) - first[row_of]
    tokens = np.zeros(num_tokens, np.int32)
    tokens[:n_real] = np.fromiter((t for r in rows for t in r.tokens), np.int32, n_real)
    positions = np.zeros(num_tokens, np.int32)
    positions[:n_real] = pos
    slots = np.full(num_tokens, PAD_SLOT, np.int32)
    slots[:n_real] = page_table[row_of, pos // page_size].astype(np.int64) * page_size + pos % page_size
    token_row = np.full(num_tokens, num_rows, np.int32)
    token_row[:n_real] = row_of
    query_start = np.full(num_rows + 1, n_real, np.int32)
    query_start[:count] = first
    context_lens = np.zeros(num_rows, np.int32)
    context_lens[:count] = ends
    logit_index = np.zeros(num_logits, np.int32)
    logit_row = np.repeat(np.arange(count), logits_per_row)
    logit_first = np.cumsum(logits_per_row) - logits_per_row
    logit_index[:n_logits] = (first + lens - logits_per_row)[logit_row] + np.arange(n_logits) - logit_first[logit_row]
    return RaggedArrays(tokens, positions, slots, token_row, query_start, context_lens, page_table, logit_index)
