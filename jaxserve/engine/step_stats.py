"""What each engine step held: its kind (decode, prefill, mixed), its real tokens and the bytes it
read (weights and K/V), for /metrics.

A row is a prompt chunk when it computes more than the sequence's newest token (a prompt, or a
recomputed sequence after preemption); otherwise it is a decode row (with speculative verification
or multi-step lookahead, its extra tokens count too). A step is "mixed" when it holds both kinds: the
sign that running streams did not wait for a prompt's step of their own. Host-only (no jax).
"""

from __future__ import annotations

from typing import Iterable

from jaxserve.engine.scheduler_output import ScheduledRow

STEP_KINDS = ("decode", "prefill", "mixed")


def is_prompt_chunk(row: ScheduledRow) -> bool:
    return row.start < row.seq.num_tokens - 1


class StepComposition:
    """Cumulative counts: steps by kind, and a histogram of real tokens per step (Prometheus-shaped)
    whose bounds are the step's token buckets, so each bucket's count is the steps that ran in it (one
    replica) and the padded slots follow from the histogram alone. `last_bytes_read`: the last step's
    weights (once per decode step in the call) and K/V read, from `param_bytes` and `kv_bytes_per_token`."""

    def __init__(self, bounds: tuple[int, ...], param_bytes: int = 0, kv_bytes_per_token: int = 0):
        self.bounds = tuple(bounds)
        self.param_bytes, self.kv_bytes_per_token = param_bytes, kv_bytes_per_token
        self.last_bytes_read = 0
        self.bucket_counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.token_sum = 0
        self.steps = dict.fromkeys(STEP_KINDS, 0)

    def record(self, rows: Iterable[ScheduledRow], calls: int = 1) -> str:
        """Count one step of these rows, dispatched as `calls` decode steps in one call (multi-step);
        returns its kind."""
        chunks = decodes = tokens = context = 0
        for row in rows:
            tokens += row.num_tokens + row.num_lookahead
            context += row.start + row.num_tokens + row.num_lookahead  # the row's K/V the step reads
            if is_prompt_chunk(row):
                chunks += 1
            else:
                decodes += 1
        kind = "mixed" if chunks and decodes else "prefill" if chunks else "decode"
        self.steps[kind] += 1
        self.token_sum += tokens
        index = next((i for i, bound in enumerate(self.bounds) if tokens <= bound), len(self.bounds))
        self.bucket_counts[index] += 1
        self.last_bytes_read = calls * self.param_bytes + context * self.kv_bytes_per_token
        return kind

    def as_stats(self) -> dict:
        return {
            "steps_by_kind": dict(self.steps),
            "iteration_tokens": {
                "bounds": list(self.bounds),
                "counts": list(self.bucket_counts),
                "sum": self.token_sum,
            },
        }
