"""InputBatch: the persistent host-side description of the running rows, one per plain bucket: the
step's packed inputs kept from step to step and rewritten only where they changed.

Building a step's inputs from scratch (a `RaggedArrays` per replica, a `SamplingTensors` of every
field, a `TokenMask`, then one concatenation of the ~20 arrays into the int32 buffer copied to the
device, `jaxserve.model.transfer.Layout`) redoes what mostly did not change since the step before: a
decode row's page table, its sampling parameters, the masks of a step without grammars. On the 2
cores the host shares with XLA, each of those small NumPy calls costs microseconds.

So the input batch keeps that buffer per bucket and writes it in place:

* the tokens, positions, slots, context lengths and output indices: every step (a decode's token
  and position move on), one slice per array and replica; the rows of the tokens, the rows' first
  tokens and the logit indices only when the rows' token counts changed; past the used prefix only
  what the step before used and this one does not (the rest still holds the padding). A steady
  decode step (the same rows as the step before, a token each) is five slice writes per replica,
  its slots computed per row in Python instead of a gather over the page table;
* a row's page-table entries: only when the row holds another table, or its table grew or released
  pages (`BlockManager.live_page_ids`: the table array itself and a version);
* a logit slot's sampling scalars: only when the slot holds another `RowSampling` (the engine keeps
  one per sequence); its output index (`step`) every step;
* the constrained flags: only in steps with (or just after) a constrained row; the mask words
  themselves are copied from the runner's mask buffer by `write_masks` when a row is constrained.

What it writes equals `Layout.pack` of the from-scratch inputs word for word
(`tests/engine/test_input_batch.py`): multi-host followers, which receive the inputs as arrays and
pack them themselves, run the very same step. The buffer is reused, so the runner copies it before
the host->device transfer (a NumPy array on a CPU device may be aliased, not copied).
"""

from __future__ import annotations

from array import array
from typing import Any, Sequence

import numpy as np

from jaxserve.model.ragged import PAD_SLOT, PADDING_PAGE
from jaxserve.model.sampler import ROW_SCALARS
from jaxserve.sampling.fields import DEVICE_FIELDS
from jaxserve.structured.apply import TokenMask
from jaxserve.model.transfer import Layout

_DEVICE_NAMES = tuple(f.name for f in DEVICE_FIELDS)
_IDLE_SCALARS = tuple((name, idle) for name, (_, idle) in ROW_SCALARS.items() if name != "step")


class InputBatch:
    """One plain (tokens, pages) bucket's packed host inputs: (RaggedBatch, SamplingTensors without
    its sparse fields, TokenMask) as views into one int32 [R, width] buffer, and what each row and
    logit slot holds, so that the next step rewrites only what changed."""

    def __init__(self, layout: Layout, *, page_size: int, idle_sparse: dict[str, np.ndarray]):
        self.layout = layout
        self.buffer = np.zeros((layout.replicas, layout.width), np.int32)
        self.batch, sampling, mask = layout.views(self.buffer)
        self.sampling_views = sampling  # its sparse fields are None: they travel apart
        # The step's SamplingTensors when no row uses penalties or logit_bias (`idle_sparse`): one
        # object for every such step, its scalars views of the buffer.
        self.idle_sampling = sampling.replace(**idle_sparse)
        R = self.replicas = layout.replicas
        self.num_tokens = self.batch.tokens.shape[1]
        self.num_rows = self.batch.context_lens.shape[1]
        self.max_pages = self.batch.page_table.shape[2]
        self.num_logits = self.batch.logit_index.shape[1]
        self.page_size = page_size
        # The padding values of pack_ragged and SamplingTensors.pack (zeros elsewhere).
        self.batch.slots[...] = PAD_SLOT
        self.batch.token_row[...] = self.num_rows
        # LoRA (None without): each row's adapter slot, -1 for the base model and padding rows; per
        # replica the slots last written, rewritten only when the rows' adapters changed.
        self._row_lora = self.batch.row_lora
        if self._row_lora is not None:
            self._row_lora[...] = -1
        self._lora_written: list[list[int]] = [[] for _ in range(layout.replicas)]
        self._scalars = {name: getattr(sampling, name) for name in ROW_SCALARS}
        for name, (_, idle) in ROW_SCALARS.items():
            self._scalars[name][...] = idle
        self._bitmask, self._constrained = mask.bitmask, mask.constrained  # the flags as int32 words
        self._bitmask[...] = -1  # as the runner's mask buffers start
        # Per replica: each row's page-table entries as (table array, version, entries written),
        # each logit slot's RowSampling written (None: idle values), rows and samples of the last step.
        self._tables: list[list[Any]] = [[None] * self.num_rows for _ in range(R)]
        self._slots: list[list[Any]] = [[None] * self.num_logits for _ in range(R)]
        self._counts = [0] * R
        self._samples = [0] * R
        self._any_constrained = False
        self._mask: TokenMask | None = None  # mask(): kept while the constrained flags stay as they are
        # Per replica: the last step's token count, per-token rows, rows' first tokens and logit
        # indices as written. A decode step whose rows are those of the step before (the steady
        # state) writes only what moves on: tokens, positions, slots, lengths, output indices.
        self._tokens_written = [0] * R
        self._layout_written: list[tuple[list[int], list[int], list[int]] | None] = [None] * R
        b = self.batch
        self._views = [
            (
                b.page_table[r],
                b.tokens[r],
                b.positions[r],
                b.token_row[r],
                b.slots[r],
                b.query_start[r],
                b.context_lens[r],
                b.logit_index[r],
                self._scalars["step"][r],
            )
            for r in range(R)
        ]

    def write(self, rows: Sequence[Any]) -> tuple[np.ndarray, list[tuple[int, int, int]], list[tuple[Any, int]]]:
        """Lay out `rows` (`StepRow`, any replicas, in row order) as `ModelRunner._pack` does;
        returns (logit_at, token_at, grammars): each row's flat sample index (-1: no sample), its
        (replica, first token, tokens), and (grammar, flat index) of each constrained row."""
        R, L = self.replicas, self.num_logits
        logit_at = [-1] * len(rows)
        token_at: list[tuple[int, int, int]] = [(0, 0, 1)] * len(rows)
        grammars: list[tuple[Any, int]] = []
        if R == 1:
            groups = [range(len(rows))]
        else:
            groups = [[] for _ in range(R)]
            for i, row in enumerate(rows):
                groups[row.replica].append(i)
        for rep, indices in enumerate(groups):
            self._write_replica(rep, rows, indices, logit_at, token_at, grammars)
        if grammars or self._any_constrained:
            self._constrained[...] = 0
            for _, at in grammars:
                self._constrained[at // L, at % L] = 1
            self._any_constrained = bool(grammars)
            self._mask = None
        return np.asarray(logit_at, np.int64), token_at, grammars

    def _write_replica(
        self, rep: int, rows: Sequence[Any], indices: Sequence[int], logit_at: list[int], token_at: list, grammars: list
    ) -> None:
        S, N, P, L, ps = self.num_rows, self.num_tokens, self.max_pages, self.num_logits, self.page_size
        if len(indices) > S:
            raise ValueError(f"{len(indices)} rows do not fit a step of {S} rows")
        page_table, tok, pos, trow, slot, qs, ctx, li, st = self._views[rep]
        tables, slots = self._tables[rep], self._slots[rep]
        tokens: list[int] = []
        positions: list[int] = []
        token_row: list[int] = []
        token_slots: list[int] = []  # while every row so far has one token (else computed below)
        single = True
        firsts: list[int] = []
        ends: list[int] = []
        logit_index: list[int] = []
        steps: list[int] = []
        t = j = 0
        for r, i in enumerate(indices):
            row = rows[i]
            n, start = len(row.tokens), row.start_pos
            end = start + n
            need = -(-end // ps)
            pages = row.page_ids
            if need > P or need > len(pages):
                raise ValueError(f"row {r}: {end} tokens need {need} pages; it has {len(pages)}, a step holds {P}")
            held, version = tables[r], row.pages_version
            if held is None or version is None or held[0] is not pages or held[1] != version or held[2] != need:
                page_table[r, :need] = (
                    np.frombuffer(pages, np.int32, need)
                    if isinstance(pages, array)
                    else np.asarray(pages[:need], np.int32)
                )
                if held is not None and held[2] > need:
                    page_table[r, need : held[2]] = PADDING_PAGE
                tables[r] = (pages if version is not None else None, version, need)
            tokens.extend(row.tokens)
            if n == 1:  # a decode row: its one slot here, from the page-table entry just written or kept
                positions.append(start)
                token_row.append(r)
                if single:
                    token_slots.append(int(page_table[r, start // ps]) * ps + start % ps)
            else:
                positions.extend(range(start, end))
                token_row.extend([r] * n)
                single = False
            firsts.append(t)
            ends.append(end)
            token_at[i] = (rep, t, n)
            t += n
            if row.samples:
                if j >= L:
                    raise ValueError(f"more than {L} rows sample; a step returns {L} logits")
                rs = row.sampling
                if slots[j] is not rs:
                    self._write_sampling(rep, j, rs)
                    slots[j] = rs
                steps.append(0 if rs is None else (rs.step if row.step is None else row.step))
                logit_index.append(t - 1)
                logit_at[i] = rep * L + j
                if row.grammar is not None:
                    grammars.append((row.grammar, rep * L + j))
                j += 1
        if t > N:
            raise ValueError(f"{t} tokens do not fit a step of {N} tokens")
        count = len(indices)
        if self._row_lora is not None:
            lora = [rows[i].lora_slot for i in indices]
            if lora != self._lora_written[rep]:
                self._row_lora[rep, :count] = lora
                self._row_lora[rep, count:] = -1
                self._lora_written[rep] = lora
        for r in range(count, self._counts[rep]):  # rows no longer used: back to the padding page
            page_table[r, : tables[r][2]] = PADDING_PAGE
            tables[r] = None
        prev_count, self._counts[rep] = self._counts[rep], count
        for k in range(j, self._samples[rep]):  # logit slots no longer used: idle values
            if slots[k] is not None:
                self._write_sampling(rep, k, None)
                slots[k] = None
        prev_j, self._samples[rep] = self._samples[rep], j
        prev_t, self._tokens_written[rep] = self._tokens_written[rep], t

        # What moves every step; past the used prefix only what the last step used and this one does
        # not (the rest still holds the padding values).
        tok[:t] = tokens
        pos[:t] = positions
        if single:
            slot[:t] = token_slots
        else:
            p = pos[:t]
            slot[:t] = page_table[token_row, p // ps] * ps + p % ps
        if t < prev_t:
            tok[t:prev_t] = 0
            pos[t:prev_t] = 0
            trow[t:prev_t] = S
            slot[t:prev_t] = PAD_SLOT
        ctx[:count] = ends
        if count < prev_count:
            ctx[count:prev_count] = 0
        st[:j] = steps
        if j < prev_j:
            li[j:prev_j] = 0
            st[j:prev_j] = 0
        # The step's shape (which row each token is, where rows start, where they sample): as written
        # last step unless the rows' token counts changed.
        layout = self._layout_written[rep]
        if layout is None or layout[0] != token_row:
            trow[:t] = token_row
        if layout is None or layout[1] != firsts or t != prev_t:
            qs[:count], qs[count:] = firsts, t
        if layout is None or layout[2] != logit_index:
            li[:j] = logit_index
        self._layout_written[rep] = (token_row, firsts, logit_index)

    def _write_sampling(self, rep: int, j: int, rs: Any) -> None:
        """Logit slot j's scalars (all but `step`) from a RowSampling, or idle for None, as
        SamplingTensors.pack writes them."""
        sc = self._scalars
        if rs is None:
            for name, idle in _IDLE_SCALARS:
                sc[name][rep, j] = idle
            return
        for name in _DEVICE_NAMES:
            sc[name][rep, j] = getattr(rs, name)
        sc["top_k"][rep, j] = max(rs.top_k, 0)  # -1 means no limit too
        sc["seed"][rep, j] = rs.seed
        sc["num_top_logprobs"][rep, j] = rs.logprobs
        sc["prompt_len"][rep, j] = len(rs.prompt_ids) if rs.uses_penalties else 0

    def write_masks(self, masks: np.ndarray) -> None:
        """The grammar masks, [R * L, W], as the runner's mask buffer holds them after filling."""
        self._bitmask[...] = masks.reshape(self._bitmask.shape)

    def mask(self) -> TokenMask:
        """This step's TokenMask as the step's inputs hold it (bitmask a view; flags as bools, made
        again only after the flags changed)."""
        if self._mask is None:
            self._mask = TokenMask(self._bitmask, self._constrained != 0)
        return self._mask
