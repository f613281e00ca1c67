"""The speculative executables, as the runner holds them: in an engine with speculative decoding
every ragged step bucket (tokens, pages) is compiled from `spec_decode.step.speculative_step`
(prompt chunks, plain decodes and verifications side by side, the draft model's proposals and
catch-up inside), so speculation adds no executables. `Speculation` gives those buckets the
interface the runner's own steps have (input specs, lowering, calls, packing): `ModelRunner` owns
them like every step (one executable table, compiled by its warm-up, run and broadcast to the
other processes of a multi-host job by `run_step`); `jaxserve.spec_decode` decides what each row
proposes.

A speculative step's host inputs: (RaggedBatch [R, N] with logit_index [R, min(N, G * W)],
SamplingTensors [R, G], SpecRows [R, G], DraftInputs or None), G = min(N, max rows), W = K + 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine.buckets import pick_step_shape
from jaxserve.model.kv_cache import KVCache, RaggedBatch, cache_shardings, init_cache
from jaxserve.model.weights import Params
from jaxserve.model.ragged import RaggedArrays, RaggedRow, pack_ragged, row_lora_slots
from jaxserve.model.sampler import RowSampling, SamplingTensors
from jaxserve.spec_decode.step import DraftInputs, SpecOptions, SpecRows, speculative_step
from jaxserve.model.transfer import Layout, from_buffer, with_sparse
from jaxserve.runner.step_io import StepInputs


@dataclasses.dataclass
class Speculation:
    """What the speculative executables take besides the target: the static choices, and the draft's
    params and KV cache (same page ids as the target's), which the runner holds and donates."""

    method: str  # "draft" | "ngram"
    num_tokens: int  # K, the most drafts a step verifies
    draft_cfg: ModelConfig | None = None
    draft_params: Params | None = None
    draft_cache: KVCache | None = None
    draft_cache_sharding: KVCache | None = None
    accept_all: bool = False  # a deliberately wrong verifier: only the test that must catch it sets this
    runner: Any = None  # the ModelRunner holding the target's params and cache, and these executables

    @classmethod
    def load(cls, runner: Any, method: str, num_tokens: int, draft: Any) -> Speculation:
        """`draft`: the loaded draft model (method "draft"; its cache is allocated here, over the same
        page ids as the runner's) or None."""
        if draft is None:
            return cls(method, num_tokens, runner=runner)
        c = runner.cache
        cache = init_cache(draft.cfg, c.num_pages, c.page_size, draft.dtype, c.num_replicas, draft.shardings.cache)
        return cls(method, num_tokens, draft.cfg, draft.params, cache, cache_shardings(draft.shardings, "auto"),
                   runner=runner)

    @property
    def width(self) -> int:
        """Logits per sampling group: the pending token's and K drafts'."""
        return self.num_tokens + 1

    # The runner's step interface (`ModelRunner.input_specs`, `lower`, `call`), for its ragged buckets.
    def input_specs(self, shape: tuple) -> tuple:
        r = self.runner
        N, P = shape
        return _step_inputs(self, N, P, r.num_logits(N), r.buckets.max_rows, r.num_replicas, r.history_len,
                            r.lora is not None)

    def lower(self, shape: tuple, layout: Layout, sparse: tuple):
        return _lower(self.runner, layout, sparse)

    def call(self, executable: Any, sparse: tuple, buffer: Any) -> Any:
        return _call(self.runner, executable, sparse, buffer)

    def pack(self, rows: Sequence[Any]) -> StepInputs:
        return _pack(self.runner, rows)


def _step_inputs(spec: Speculation, N: int, P: int, G: int, S: int, R: int, history_len: int,
                 lora: bool = False) -> tuple:
    """ShapeDtypeStructs of a speculative step's host inputs (see the module docstring); with `lora`
    the target's batch carries each row's adapter slot (the draft model has no adapters)."""
    def i32(*dims):
        return jax.ShapeDtypeStruct((R,) + dims, jnp.int32)

    def ragged(n, logits, row_lora=False):
        return RaggedBatch(tokens=i32(n), positions=i32(n), slots=i32(n), token_row=i32(n), query_start=i32(S + 1),
                           context_lens=i32(S), page_table=i32(S, P), logit_index=i32(logits),
                           row_lora=i32(S) if row_lora else None)

    rows = SpecRows(num_draft=i32(G), want_logprobs=jax.ShapeDtypeStruct((R, G), jnp.bool_),
                    group_logits=i32(G * spec.width))
    draft = None
    if spec.method == "draft":
        draft = DraftInputs(batch=ragged(N, G), draft_index=i32(G, spec.num_tokens), group_row=i32(G))
    return ragged(N, num_logits(N, G, spec), lora), SamplingTensors.spec((R, G), history_len), rows, draft


def num_logits(N: int, G: int, spec: Speculation) -> int:
    """Real logits a step of N tokens and G sampling groups may hold: one per token at most, and at
    most W per group (the forward computes these only; the groups index them)."""
    return min(N, G * spec.width)


def _step(params, cache, draft_params, draft_cache, carried, sparse, batch, sampling, rows, draft, *, cfg, draft_cfg,
          options, spec, cache_sharding=None, draft_cache_sharding=None, out_sharding=None):
    """The executable's calling convention: `carried` (the plain steps' placeholder tokens) passes
    through, since speculative engines run each step to completion; `sparse`: the sampling's
    penalty histories and logit-bias slots, as the plain steps take them."""
    out, cache, draft_cache = speculative_step(
        params, cache, draft_params, draft_cache, batch, with_sparse(sampling, sparse), rows, draft, cfg=cfg,
        draft_cfg=draft_cfg, options=options, spec=spec, cache_sharding=cache_sharding,
        draft_cache_sharding=draft_cache_sharding)
    if out_sharding is not None:  # multi-host: every process reads its own full copy of the outputs
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out, cache, draft_cache, carried


# Compiled as (params, cache, draft params, draft cache, carried, sparse, packed inputs): see jaxserve.model.transfer.
_step_jit = jax.jit(from_buffer(_step, 6), static_argnames=(
    "layout", "cfg", "draft_cfg", "options", "spec", "cache_sharding", "draft_cache_sharding", "out_sharding"),
    donate_argnums=(1, 3))


def _lower(runner: Any, layout: Layout, sparse: tuple):
    """Lower a speculative step for the runner's params, caches and shardings (inputs packed by
    `layout`; `sparse`: the ShapeDtypeStructs of the sampling's sparse operands)."""
    spec = runner.speculation
    cache_sharding = None if runner.shardings is None else cache_shardings(
        runner.shardings, "int8" if runner.cache.quantized else "auto")
    carried = jax.ShapeDtypeStruct(runner.carried.shape, jnp.int32, sharding=runner.carry_sharding)
    options = SpecOptions(method=spec.method, num_tokens=spec.num_tokens, accept_all=spec.accept_all)
    return _step_jit.trace(
        runner.params, runner.cache, spec.draft_params, spec.draft_cache, carried, sparse,
        layout.spec(runner.buffer_sharding), layout=layout, cfg=runner.cfg, draft_cfg=spec.draft_cfg,
        options=runner.options, spec=options, cache_sharding=cache_sharding,
        draft_cache_sharding=spec.draft_cache_sharding, out_sharding=runner.out_sharding).lower()


def _call(runner: Any, executable: Any, sparse: tuple, buffer: jax.Array) -> Any:
    """Run a compiled speculative step on packed device inputs, replacing the donated caches; returns
    the VerifyOutput ([R, G] leading, on the device)."""
    spec = runner.speculation
    out, runner.cache, spec.draft_cache, runner.carried = executable(
        runner.params, runner.cache, spec.draft_params, spec.draft_cache, runner.carried, sparse, buffer)
    return out


def _pack(runner: Any, rows: Sequence[Any]):
    """Lay `rows` (the runner's RowWork: prompt chunks, decodes, verifications) out in the smallest
    bucket as a speculative step: a StepInputs whose `speculative` holds (SpecRows, DraftInputs)."""
    spec = runner.speculation
    R, S, ps = runner.num_replicas, runner.buckets.max_rows, runner.cache.page_size
    K, W = spec.num_tokens, spec.width
    per_replica = [[i for i, r in enumerate(rows) if r.replica == rep] for rep in range(R)]
    pages = [r.page_ids[: -(-(r.start_pos + len(r.tokens)) // ps)] for r in rows]
    n_tokens = max(sum(len(rows[i].tokens) for i in idx) for idx in per_replica)
    shape = pick_step_shape(runner.buckets, n_tokens, max(len(p) for p in pages))
    N, P = shape
    G = runner.num_logits(N)
    draft = spec.method == "draft"
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
        arrays = pack_ragged([RaggedRow(rows[i].tokens, rows[i].start_pos, pages[i],
                                        (1 + rows[i].num_drafts) if rows[i].samples else 0) for i in indices],
                             page_size=ps, num_tokens=N, num_rows=S, max_pages=P, num_logits=L)
        g = c = 0  # the next group, and its first entry in arrays.logit_index
        for k, i in enumerate(indices):
            row, first = rows[i], int(arrays.query_start[k])
            token_at[i] = (rep, first, len(row.tokens))
            if not row.samples:
                continue
            w = 1 + row.num_drafts
            group_logits[rep, g * W: (g + 1) * W] = c + np.minimum(np.arange(W), w - 1)
            flat_sampling[rep * G + g] = row.sampling
            if row.sampling is not None:
                flat_steps[rep * G + g] = row.sampling.step if row.step is None else row.step
            num_draft[rep, g], want_logprobs[rep, g], group_row[rep, g] = row.num_drafts, row.want_logprobs, k
            draft_index[rep, g, : row.num_drafts] = first + 1 + np.arange(row.num_drafts)
            logit_at[i] = rep * G + g
            g, c = g + 1, c + w
        _append(fields, arrays)
        if draft:
            _append(draft_fields, _draft_arrays([rows[i] for i in indices], [pages[i] for i in indices], ps, N, S, P,
                                                G))
    batch = RaggedBatch(**{name: np.stack(v) for name, v in fields.items()},
                        row_lora=np.stack(row_lora) if runner.lora is not None else None)
    st = SamplingTensors.pack(flat_sampling, (R, G), runner.history_len, steps=flat_steps)
    draft_inputs = None
    if draft:
        draft_inputs = DraftInputs(batch=RaggedBatch(**{name: np.stack(v) for name, v in draft_fields.items()}),
                                   draft_index=draft_index, group_row=group_row)
    return StepInputs(shape, batch, st, None, logit_at, token_at,
                      speculative=(SpecRows(num_draft, want_logprobs, group_logits), draft_inputs))


def _draft_arrays(rows: Sequence[Any], pages: Sequence[Any], page_size: int, num_tokens: int, num_rows: int,
                  max_pages: int, num_groups: int) -> RaggedArrays:
    """The draft model's batch of one replica: each row's tokens the draft's cache lacks (a row's own
    tokens, drafts excluded, unless it names others) and a logit at the last of each sampling row's."""
    def own(r):  # (tokens, start) the draft takes for row r
        if r.draft_tokens is None:
            return r.tokens[: len(r.tokens) - r.num_drafts], r.start_pos
        return r.draft_tokens, r.draft_start

    return pack_ragged([RaggedRow(*own(r), p, int(r.samples)) for r, p in zip(rows, pages)],
                       page_size=page_size, num_tokens=num_tokens, num_rows=num_rows, max_pages=max_pages,
                       num_logits=num_groups)


def _append(fields: dict[str, list], arrays: RaggedArrays) -> None:
    for name in fields:
        fields[name].append(getattr(arrays, name))
