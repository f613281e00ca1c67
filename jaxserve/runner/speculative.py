"""The speculative step variant: in an engine with speculative decoding every ragged step bucket
(tokens, pages) is compiled from `spec_decode.step.speculative_step` (prompt chunks, plain decodes
and verifications side by side, the draft model's proposals and catch-up inside), so speculation
adds no executables. The runner holds and runs them like every variant's; `jaxserve.spec_decode`
decides what each row proposes.

A speculative step's host inputs: (RaggedBatch [R, N] with logit_index [R, min(N, G * W)],
SamplingTensors [R, G], SpecRows [R, G], DraftInputs or None), G = min(N, max rows), W = K + 1.

Like a plain step it takes and gives the carried samples (`jaxserve.model.placeholders`): a step
that verifies nothing can follow the one before it without its tokens reaching the host (async
scheduling, `engine/overlap.py`), its pending tokens named by placeholders in the target's batch,
the draft's and the penalty histories alike, and it carries each group's last emitted token for
the step after it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import KVCache, RaggedBatch, cache_shardings, init_cache
from jaxserve.model.weights import Params
from jaxserve.model.ragged import RaggedArrays, RaggedRow, pack_ragged, row_lora_slots
from jaxserve.model.placeholders import carry_tokens, resolve
from jaxserve.model.sampler import RowSampling, SamplingTensors
from jaxserve.spec_decode.eagle3_draft import eagle3_start_arrays, eagle_cache_sharding, init_eagle_cache
from jaxserve.spec_decode.step import DraftInputs, SpecOptions, SpecRows, speculative_step
from jaxserve.model.transfer import Layout, from_buffer, with_sparse
from jaxserve.runner.step_io import StepInputs, StepSamples
from jaxserve.runner.step_variant import DeviceState, StepContext, StepVariant, flat_rows


class SpeculativeStep(StepVariant):
    """A speculative engine's ragged step: it replaces the plain step (and multi-step) for every
    bucket, so speculation adds no executables. With the draft method the device state holds the
    draft's params and a cache of its own over the same page ids, donated like the target's."""

    def __init__(self, ctx: StepContext, state: DeviceState, method: str, num_tokens: int, draft: Any = None):
        super().__init__(ctx)
        self.state = state
        self.method = method  # "draft" | "eagle3" | "ngram"
        self.num_tokens = num_tokens  # K, the most drafts a step verifies
        self.accept_all = False  # a deliberately wrong verifier: only the test that must catch it sets this
        self.draft_cfg: ModelConfig | None = None
        self.draft_cache_sharding: Any = None
        if draft is not None and method == "eagle3":
            self.draft_cfg, self.draft_cache_sharding = draft.cfg, eagle_cache_sharding(ctx.shardings)
            state.draft_params = draft.params
            state.draft_cache = init_eagle_cache(draft.cfg, state.cache, draft.dtype, self.draft_cache_sharding)
        elif draft is not None:
            c = state.cache
            state.draft_params = draft.params
            state.draft_cache = init_cache(
                draft.cfg, c.num_pages, c.page_size, draft.dtype, c.num_replicas, draft.shardings.cache
            )
            self.draft_cfg = draft.cfg
            self.draft_cache_sharding = cache_shardings(draft.shardings, "auto")

    # The draft's weights and cache, as the device state holds them (None without a draft, or closed).
    @property
    def draft_params(self) -> Params | None:
        return self.state.draft_params

    @property
    def draft_cache(self) -> KVCache | None:
        return self.state.draft_cache

    @property
    def width(self) -> int:
        """Logits per sampling group: the pending token's and K drafts'."""
        return self.num_tokens + 1

    def accepts(self, rows: Sequence[Any]) -> bool:
        return True

    def input_specs(self, key: tuple) -> tuple:
        """(RaggedBatch [R, N] with logit_index [R, min(N, G * W)], SamplingTensors [R, G], SpecRows
        [R, G], DraftInputs or None); the draft model's batch carries no adapter slots."""
        c = self.ctx
        N, P = key[:2]
        G, R = c.num_logits(N), c.num_replicas
        rows = SpecRows(
            num_draft=c.i32(G),
            want_logprobs=jax.ShapeDtypeStruct((R, G), jnp.bool_),
            group_logits=c.i32(G * self.width),
        )
        draft = None
        if self.method in ("draft", "eagle3"):
            draft = DraftInputs(
                batch=c.ragged_spec(G if self.method == "eagle3" else N, P, G, lora=False),
                draft_index=c.i32(G, self.num_tokens),
                group_row=c.i32(G),
            )
        return c.ragged_spec(N, P, num_logits(N, G, self)), SamplingTensors.spec((R, G), c.history_len), rows, draft

    def lower(self, key: tuple, state: DeviceState, layout: Layout, sparse: tuple):
        c = self.ctx
        carried = jax.ShapeDtypeStruct(state.carried.shape, jnp.int32, sharding=c.carry_sharding)
        options = SpecOptions(method=self.method, num_tokens=self.num_tokens, accept_all=self.accept_all)
        return _step_jit.trace(
            state.params,
            state.cache,
            state.draft_params,
            state.draft_cache,
            carried,
            sparse,
            layout.spec(c.buffer_sharding),
            layout=layout,
            cfg=c.cfg,
            draft_cfg=self.draft_cfg,
            options=c.options,
            spec=options,
            cache_sharding=c.cache_sharding,
            draft_cache_sharding=self.draft_cache_sharding,
            out_sharding=c.out_sharding,
            carry_sharding=c.carry_sharding,
        ).lower()

    def call(self, executable: Any, state: DeviceState, sparse: tuple, buffer: Any) -> Any:
        """Run a compiled speculative step, replacing the donated caches; returns the VerifyOutput
        ([R, G] leading, on the device)."""
        out, state.cache, state.draft_cache, state.carried = executable(
            state.params, state.cache, state.draft_params, state.draft_cache, state.carried, sparse, buffer
        )
        return out

    def pack(self, rows: Sequence[Any], key: tuple, layout: Layout) -> StepInputs:
        return _pack(self, rows, key)

    def key_for(self, rows: Sequence[Any]) -> tuple:
        return self.ctx.bucket_for(rows)

    def unpack(self, out: Any, packed: StepInputs) -> StepSamples:
        """[rows, K + 1]: the accepted drafts, then the target's token."""
        rows = jax.tree.map(lambda x: flat_rows(x, packed.logit_at), out)
        emitted = np.where(packed.logit_at >= 0, rows.num_accepted + 1, 0).astype(np.int32)
        return StepSamples(rows.tokens, emitted, rows.logprobs, rows.top_ids, rows.top_logprobs)


def num_logits(N: int, G: int, spec: SpeculativeStep) -> int:
    """Real logits a step of N tokens and G sampling groups may hold: one per token at most, and at
    most W per group (the forward computes these only; the groups index them)."""
    return min(N, G * spec.width)


def _step(
    params,
    cache,
    draft_params,
    draft_cache,
    carried,
    sparse,
    batch,
    sampling,
    rows,
    draft,
    *,
    cfg,
    draft_cfg,
    options,
    spec,
    cache_sharding=None,
    draft_cache_sharding=None,
    out_sharding=None,
    carry_sharding=None,
):
    """The executable's calling convention, as the plain step's: `carried` i32[R, S] the previous
    step's samples, which every placeholder in the inputs names (the target's and the draft's tokens,
    the penalty histories); `sparse`: the sampling's penalty histories and logit-bias slots. Returns
    the step's carried samples: each group's last emitted token, at its slot g (a plain sample's
    placeholder names it; a verifying step's are read on the host before the next is scheduled)."""
    sampling = with_sparse(sampling, sparse)
    batch = batch.replace(tokens=resolve(batch.tokens, carried))
    sampling = sampling.replace(history=resolve(sampling.history, carried))
    if draft is not None:
        draft = draft.replace(batch=draft.batch.replace(tokens=resolve(draft.batch.tokens, carried)))
    out, cache, draft_cache = speculative_step(
        params,
        cache,
        draft_params,
        draft_cache,
        batch,
        sampling,
        rows,
        draft,
        cfg=cfg,
        draft_cfg=draft_cfg,
        options=options,
        spec=spec,
        cache_sharding=cache_sharding,
        draft_cache_sharding=draft_cache_sharding,
    )
    if out_sharding is not None:  # multi-host: every process reads its own full copy of the outputs
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    last = jnp.take_along_axis(out.tokens, out.num_accepted[..., None], axis=-1)[..., 0]  # i32[R, G]
    carried = carry_tokens(last, carried.shape[-1])
    if carry_sharding is not None:
        carried = jax.lax.with_sharding_constraint(carried, carry_sharding)
    return out, cache, draft_cache, carried


# Compiled as (params, cache, draft params, draft cache, carried, sparse, packed inputs): see jaxserve.model.transfer.
_step_jit = jax.jit(
    from_buffer(_step, 6),
    static_argnames=(
        "layout",
        "cfg",
        "draft_cfg",
        "options",
        "spec",
        "cache_sharding",
        "draft_cache_sharding",
        "out_sharding",
        "carry_sharding",
    ),
    donate_argnums=(1, 3),
)


def _pack(spec: SpeculativeStep, rows: Sequence[Any], shape: tuple) -> StepInputs:
    """Lay `rows` (StepRow: prompt chunks, decodes, verifications) out in bucket `shape` as a
    speculative step: a StepInputs whose `speculative` holds (SpecRows, DraftInputs)."""
    ctx = spec.ctx
    R, S, ps = ctx.num_replicas, ctx.max_rows, ctx.page_size
    K, W = spec.num_tokens, spec.width
    per_replica = [[i for i, r in enumerate(rows) if r.replica == rep] for rep in range(R)]
    pages = [r.page_ids[: -(-(r.start_pos + len(r.tokens)) // ps)] for r in rows]
    N, P = shape
    G = ctx.num_logits(N)
    draft, eagle3 = spec.method == "draft", spec.method == "eagle3"
    fields: dict[str, list] = {f.name: [] for f in dataclasses.fields(RaggedArrays)}
    draft_fields: dict[str, list] = {f.name: [] for f in dataclasses.fields(RaggedArrays)}
    row_lora = [row_lora_slots([rows[i].lora_slot for i in indices], S) for indices in per_replica]
    flat_sampling: list[RowSampling | None] = [None] * (R * G)
    flat_steps = [0] * (R * G)
    num_draft = np.zeros((R, G), np.int32)
    want_logprobs = np.zeros((R, G), bool)
    group_logits = np.zeros((R, G * W), np.int32)
    L = num_logits(N, G, spec)
    draft_index = np.full((R, G, K), N, np.int32)
    group_row = np.zeros((R, G), np.int32)
    logit_at = np.full(len(rows), -1, np.int64)
    token_at: list[tuple[int, int, int]] = [(0, 0, 1)] * len(rows)
    for rep, indices in enumerate(per_replica):
        arrays = pack_ragged(
            [
                RaggedRow(
                    rows[i].tokens, rows[i].start_pos, pages[i], (1 + rows[i].num_drafts) if rows[i].samples else 0
                )
                for i in indices
            ],
            page_size=ps,
            num_tokens=N,
            num_rows=S,
            max_pages=P,
            num_logits=L,
        )
        g = c = 0  # the next group, and its first entry in arrays.logit_index
        for k, i in enumerate(indices):
            row, first = rows[i], int(arrays.query_start[k])
            token_at[i] = (rep, first, len(row.tokens))
            if not row.samples:
                continue
            w = 1 + row.num_drafts
            group_logits[rep, g * W : (g + 1) * W] = c + np.minimum(np.arange(W), w - 1)
            flat_sampling[rep * G + g] = row.sampling
            if row.sampling is not None:
                flat_steps[rep * G + g] = row.sampling.step if row.step is None else row.step
            num_draft[rep, g], want_logprobs[rep, g], group_row[rep, g] = row.num_drafts, row.want_logprobs, k
            draft_index[rep, g, : row.num_drafts] = first + 1 + np.arange(row.num_drafts)
            logit_at[i] = rep * G + g
            g, c = g + 1, c + w
        _append(fields, arrays)
        if draft:
            _append(
                draft_fields, _draft_arrays([rows[i] for i in indices], [pages[i] for i in indices], ps, N, S, P, G)
            )
        elif eagle3:
            group_rows = [rows[i] for i in indices if rows[i].samples]
            _append(
                draft_fields,
                eagle3_start_arrays(group_rows, [pages[i] for i in indices if rows[i].samples], ps, G, S, P),
            )
    batch = RaggedBatch(
        **{name: np.stack(v) for name, v in fields.items()}, row_lora=np.stack(row_lora) if ctx.lora else None
    )
    st = SamplingTensors.pack(flat_sampling, (R, G), ctx.history_len, steps=flat_steps)
    draft_inputs = None
    if draft or eagle3:
        draft_inputs = DraftInputs(
            batch=RaggedBatch(**{name: np.stack(v) for name, v in draft_fields.items()}),
            draft_index=draft_index,
            group_row=group_row,
        )
    return StepInputs(
        shape, batch, st, None, logit_at, token_at, (SpecRows(num_draft, want_logprobs, group_logits), draft_inputs)
    )


def _draft_arrays(
    rows: Sequence[Any],
    pages: Sequence[Any],
    page_size: int,
    num_tokens: int,
    num_rows: int,
    max_pages: int,
    num_groups: int,
) -> RaggedArrays:
    """The draft model's batch of one replica: each row's tokens the draft's cache lacks (a row's own
    tokens, drafts excluded, unless it names others) and a logit at the last of each sampling row's."""

    def own(r):  # (tokens, start) the draft takes for row r
        if r.draft_tokens is None:
            return r.tokens[: len(r.tokens) - r.num_drafts], r.start_pos
        return r.draft_tokens, r.draft_start

    return pack_ragged(
        [RaggedRow(*own(r), p, int(r.samples)) for r, p in zip(rows, pages)],
        page_size=page_size,
        num_tokens=num_tokens,
        num_rows=num_rows,
        max_pages=max_pages,
        num_logits=num_groups,
    )


def _append(fields: dict[str, list], arrays: RaggedArrays) -> None:
    for name in fields:
        fields[name].append(getattr(arrays, name))
