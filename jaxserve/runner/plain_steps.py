"""The step variants compiled from `runner/step_functions.py`: the plain ragged step (every engine's
step: prompt chunks and decodes in one flat batch, a sample per row that samples), its prompt-scoring
form (prompt logprobs: every token's logits scored) and the multi-step decode scan
(`num_scheduler_steps`: several decode steps in one call)."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from jaxserve.engine.buckets import MULTI_STEP, SCORE, score_shapes, step_shapes
from jaxserve.model.sampler import RowSampling, SamplingTensors
from jaxserve.model.transfer import SPARSE_FIELDS, Layout
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.row_packing import pack_rows
from jaxserve.runner.step_functions import generate_step, multi_decode_step, score_step
from jaxserve.runner.step_io import StepInputs, StepSamples
from jaxserve.runner.step_variant import StepContext, StepVariant, flat_rows, without_logprobs
from jaxserve.structured.apply import TokenMask


def plain_inputs(ctx: StepContext, key: tuple, logits: int | None = None) -> tuple:
    """(RaggedBatch, SamplingTensors, TokenMask) specs of bucket `key`: L = one logit per sampling row
    (`logits`: how many the batch lists, if more)."""
    N, P = key[:2]
    L = ctx.num_logits(N)
    return (
        ctx.ragged_spec(N, P, L if logits is None else logits),
        SamplingTensors.spec((ctx.num_replicas, L), ctx.history_len),
        TokenMask.spec((ctx.num_replicas, L), ctx.cfg.vocab_size),
    )


class PlainStep(StepVariant):
    """The ragged step. Its inputs live in one persistent `InputBatch` per bucket, rewritten only
    where the rows changed since the bucket's last step."""

    jitted = generate_step

    def __init__(self, ctx: StepContext, idle_host_sparse: Any):
        super().__init__(ctx)
        self._idle_host_sparse = idle_host_sparse  # L -> the sparse sampling inputs no row uses (host)
        self._input_batches: dict[tuple, InputBatch] = {}

    def accepts(self, rows: Sequence[Any]) -> bool:
        return True

    def input_specs(self, key: tuple) -> tuple:
        return plain_inputs(self.ctx, key)

    def pack(self, rows: Sequence[Any], key: tuple, layout: Layout) -> StepInputs:
        c = self.ctx
        writer = self._input_batches.get(key)
        if writer is None:
            L = c.num_logits(key[0])
            writer = self._input_batches[key] = InputBatch(
                layout, page_size=c.page_size, idle_sparse=dict(zip(SPARSE_FIELDS, self._idle_host_sparse(L)))
            )
        logit_at, token_at, grammars = writer.write(rows)
        R, L = c.num_replicas, writer.num_logits
        if any(
            r.sampling is not None and r.samples and (r.sampling.uses_penalties or r.sampling.logit_bias) for r in rows
        ):  # the sparse inputs, built for the steps that need them
            flat: list[RowSampling | None] = [None] * (R * L)
            steps = [0] * (R * L)
            for row, at in zip(rows, logit_at.tolist()):
                if at >= 0 and row.sampling is not None:
                    flat[at] = row.sampling
                    steps[at] = row.sampling.step if row.step is None else row.step
            full = SamplingTensors.pack(flat, (R, L), c.history_len, steps=steps)
            sampling = writer.sampling_views.replace(**{name: getattr(full, name) for name in SPARSE_FIELDS})
        else:
            sampling = writer.idle_sampling
        if grammars:
            writer.write_masks(c.grammar_masks.fill(L, grammars).bitmask)
        return StepInputs(key, writer.batch, sampling, writer.mask(), logit_at, token_at, buffer=writer.buffer)

    def fetched(self, out: Any, logprobs: bool) -> Any:
        return out if logprobs else out.tokens  # no row asked: its tokens alone, one array

    def unpack(self, out: Any, packed: StepInputs) -> StepSamples:
        emitted = (packed.logit_at >= 0).astype(np.int32)
        if isinstance(out, np.ndarray):  # the tokens alone
            return StepSamples(flat_rows(out, packed.logit_at)[:, None], emitted)
        rows = [
            None if x is None else flat_rows(x, packed.logit_at)[:, None]
            for x in (out.tokens, out.logprobs, out.top_ids, out.top_logprobs)
        ]
        return StepSamples(rows[0], emitted, *rows[1:])

    def clear(self) -> None:
        self._input_batches.clear()


class ScoreStep(StepVariant):
    """The ragged step that also scores every token against the next (prompt logprobs): a step with
    a row that asks for them runs it instead of the plain step (compiled when they are enabled)."""

    tag = (SCORE,)
    jitted = score_step

    def keys(self) -> list[tuple]:
        return score_shapes(self.ctx.buckets)

    def accepts(self, rows: Sequence[Any]) -> bool:
        return any(r.targets is not None for r in rows)

    def input_specs(self, key: tuple) -> tuple:
        """The plain step's, with logits at every token, plus (sample index, targets)."""
        c, N = self.ctx, key[0]
        return plain_inputs(c, key, logits=N) + (c.i32(c.num_logits(N)), c.i32(N))

    def pack(self, rows: Sequence[Any], key: tuple, layout: Layout) -> StepInputs:
        return pack_rows(self.ctx, rows, key, score=True)

    def fetched(self, out: Any, logprobs: bool) -> Any:
        return out if logprobs else (without_logprobs(out[0]), out[1])

    def unpack(self, out: Any, packed: StepInputs) -> StepSamples:
        sampled, scores = out
        width = max(n for _, _, n in packed.token_at)
        index = np.asarray([[min(t + j, t + n - 1) for j in range(width)] for _, t, n in packed.token_at])
        replica = np.asarray([rep for rep, _, _ in packed.token_at])[:, None]
        scores = jax.tree.map(lambda x: x[replica, index], scores)
        rows = [
            None if x is None else flat_rows(x, packed.logit_at)[:, None]
            for x in (sampled.tokens, sampled.logprobs, sampled.top_ids, sampled.top_logprobs)
        ]
        return StepSamples(rows[0], (packed.logit_at >= 0).astype(np.int32), *rows[1:], scores=scores)


class MultiStep(StepVariant):
    """`num_scheduler_steps` decode steps in one call, for a step of decode rows of which one takes
    more than one step (`StepRow.num_steps`); compiled for the decode-sized buckets."""

    tag = (MULTI_STEP,)
    jitted = multi_decode_step

    def keys(self) -> list[tuple]:
        return [k for k in step_shapes(self.ctx.buckets, self.ctx.num_scheduler_steps) if self.owns(k)]

    def accepts(self, rows: Sequence[Any]) -> bool:
        steps = [r.num_steps for r in rows]
        if max(steps, default=1) <= 1:
            return False
        if max(steps) > self.ctx.num_scheduler_steps or any(len(r.tokens) != 1 or not r.samples for r in rows):
            raise ValueError(
                f"a multi-step call takes decode rows only (one token each, sampling), each of "
                f"1 to {self.ctx.num_scheduler_steps} steps; got {steps}"
            )
        return True

    def key_for(self, rows: Sequence[Any]) -> tuple:
        return self.ctx.bucket_for(rows, [r.num_steps - 1 for r in rows]) + self.tag

    def input_specs(self, key: tuple) -> tuple:
        """The plain step's, plus each row's number of decode steps."""
        return plain_inputs(self.ctx, key) + (self.ctx.i32(self.ctx.max_rows),)

    def static(self, key: tuple) -> dict:
        return super().static(key) | dict(num_steps=self.ctx.num_scheduler_steps, page_size=self.ctx.page_size)

    def pack(self, rows: Sequence[Any], key: tuple, layout: Layout) -> StepInputs:
        steps = [r.num_steps for r in rows]
        packed = pack_rows(self.ctx, rows, key, extra_steps=[n - 1 for n in steps])
        steps_per_row = np.zeros((self.ctx.num_replicas, self.ctx.max_rows), np.int32)
        for (rep, t, _), n in zip(packed.token_at, steps):
            steps_per_row[rep, t] = n  # a pure decode step: row k's token is token k
        packed.extra, packed.num_steps = (steps_per_row,), steps
        return packed

    def unpack(self, out: Any, packed: StepInputs) -> StepSamples:
        # [steps, R, L, ...] -> [rows, steps, ...]
        runs = {
            f: None
            if x is None
            else np.moveaxis(x.reshape(x.shape[:1] + (-1,) + x.shape[3:])[:, np.maximum(packed.logit_at, 0)], 0, 1)
            for f, x in (
                ("tokens", out.tokens),
                ("logprobs", out.logprobs),
                ("top_ids", out.top_ids),
                ("top_logprobs", out.top_logprobs),
            )
        }
        return StepSamples(num_emitted=np.asarray(packed.num_steps, np.int32), **runs)
