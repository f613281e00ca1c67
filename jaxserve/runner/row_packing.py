"""A step's rows laid out from scratch: `pack_ragged` per replica, a `SamplingTensors` of every
field, the grammar masks. The plain step keeps its inputs in a persistent `InputBatch` instead
(only what changed is rewritten); the scoring and multi-step variants, which run rarely, lay their
rows out here."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from jaxserve.model.kv_cache import RaggedBatch
from jaxserve.model.ragged import RaggedArrays, RaggedRow, pack_ragged, row_lora_slots
from jaxserve.model.sampler import RowSampling, SamplingTensors
from jaxserve.runner.step_io import StepInputs


def pack_rows(
    ctx: Any, rows: Sequence[Any], key: tuple, score: bool = False, extra_steps: Sequence[int] | None = None
) -> StepInputs:
    """`rows` (StepRow) in bucket `key` of the plain step's inputs. `score`: logits at every token,
    the sampler taking the rows' own (`score_inputs`: sample index [R, L], targets [R, N]).
    `extra_steps`: each row's decode steps after its first in the same call (multi-step), whose
    pages are read too."""
    R, S, ps = ctx.num_replicas, ctx.max_rows, ctx.page_size
    N, P = key[:2]
    L = ctx.num_logits(N)
    extra = extra_steps or [0] * len(rows)
    per_replica = [[i for i, r in enumerate(rows) if r.replica == rep] for rep in range(R)]
    pages = [
        r.page_ids[: min(len(r.page_ids), -(-(r.start_pos + len(r.tokens) + n) // ps))] for r, n in zip(rows, extra)
    ]
    fields: dict[str, list] = {f.name: [] for f in dataclasses.fields(RaggedArrays)}
    row_lora = [row_lora_slots([rows[i].lora_slot for i in indices], S) for indices in per_replica]
    flat_sampling: list[RowSampling | None] = [None] * (R * L)
    flat_steps = [0] * (R * L)
    logit_at = np.full(len(rows), -1, np.int64)
    token_at: list[tuple[int, int, int]] = [(0, 0, 1)] * len(rows)
    sample_index = np.zeros((R, L), np.int32)
    targets = np.zeros((R, N), np.int32)
    for rep, indices in enumerate(per_replica):
        arrays = pack_ragged(
            [RaggedRow(rows[i].tokens, rows[i].start_pos, pages[i], int(rows[i].samples)) for i in indices],
            page_size=ps,
            num_tokens=N,
            num_rows=S,
            max_pages=P,
            num_logits=L,
        )
        j = 0
        for k, i in enumerate(indices):
            row, first = rows[i], int(arrays.query_start[k])
            token_at[i] = (rep, first, len(row.tokens))
            if row.samples:
                flat_sampling[rep * L + j] = row.sampling
                if row.sampling is not None:
                    flat_steps[rep * L + j] = row.sampling.step if row.step is None else row.step
                logit_at[i] = rep * L + j
                j += 1
            if row.targets is not None:
                targets[rep, first : first + len(row.targets)] = row.targets
        if score:  # logits at every token; the sampler takes the rows' own
            sample_index[rep] = arrays.logit_index
            arrays = dataclasses.replace(arrays, logit_index=np.arange(N, dtype=np.int32))
        for name in fields:
            fields[name].append(getattr(arrays, name))
    batch = RaggedBatch(
        **{name: np.stack(v) for name, v in fields.items()}, row_lora=np.stack(row_lora) if ctx.lora else None
    )
    st = SamplingTensors.pack(flat_sampling, (R, L), ctx.history_len, steps=flat_steps)
    grammars = [
        (rows[i].grammar, int(logit_at[i]))
        for i in range(len(rows))
        if rows[i].grammar is not None and logit_at[i] >= 0
    ]
    return StepInputs(
        key,
        batch,
        st,
        ctx.grammar_masks.fill(L, grammars),
        logit_at,
        token_at,
        (sample_index, targets) if score else (),
    )
