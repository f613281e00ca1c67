"""The shape buckets of the compiled steps, and the executables they make (host code: no jax).

Every step shape comes from a small fixed table compiled at start-up. The engine's step is ragged
(`jaxserve.model.ragged`): one flat axis of `N` tokens in which decodes and prompt chunks sit side by
side, so its executables are keyed by the token-budget bucket `N` alone (powers of two up to the
budget): every step takes the largest page table, since every attention backend reads only the pages
each row's queries see (the Pallas kernels, and on a CPU `layers.ragged_attention_blocked`). The
runner compiles one executable per entry of the lists below (with speculative decoding the ragged
steps are speculative ones: verifications ride in the same buckets), and
`executable_counts` says, from the settings alone, how many that is, so the count can be checked,
logged and budgeted without compiling anything.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

MULTI_STEP = "multi-step"  # the decode variant running num_scheduler_steps decode steps per call
SCORE = "score"  # the prefill variant that also scores every prompt token (prompt_logprobs)


def powers_of_two(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    """lo, 2lo, 4lo, ... (or lo, factor·lo, ...) capped by hi, with hi itself always included."""
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= factor
    out.append(hi)
    return tuple(sorted(set(out)))


TOKEN_LADDERS = ("powers-of-two", "fine", "auto")


def resolve_token_ladder(settings: Any, platform: str | None) -> str:
    """The ladder `settings.token_buckets` names; `auto` is fine on a CPU, where a step costs its
    padded tokens (a probe: 4 decodes + a 150-token chunk take 440 ms in a 160-token bucket, 555 ms
    in 256), and powers of two on accelerators, where a step of up to hundreds of tokens costs about
    its weight reads and start-up wants few executables (about 10). Also powers of two with prompt logprobs:
    their scoring variant of every bucket would make fine's 17 executables 33, over the CPU's 30.
    `platform` is jax's backend name, needed only for `auto`."""
    if settings.token_buckets != "auto":
        return settings.token_buckets
    if platform is None:
        raise ValueError("token_buckets=auto depends on the platform: pass platform (jax.default_backend())")
    return "fine" if platform == "cpu" and not settings.enable_prompt_logprobs else "powers-of-two"


def token_ladder(most: int, ladder: str) -> tuple[int, ...]:
    """The ragged step's token buckets up to `most` (the step's budget, never below its rows).

    powers-of-two: 1 (batch-1 decode), then 4, 8, 16, ... (two rows take the 4-token bucket).
    fine: powers of two and the midpoints between them, 1, 2, 3, 4, 6, 8, 12, 16, 24, ...: a step pads
    at most a third of its slots instead of half, for twice the executables."""
    coarse = {1, *powers_of_two(min(4, most), most)}
    if ladder == "powers-of-two":
        return tuple(sorted(coarse))
    if ladder != "fine":
        raise ValueError(f"unknown token ladder {ladder!r}; one of {TOKEN_LADDERS}")
    # 2 is the power of two that `coarse` skips; 3 is its midpoint.
    midpoints = {3 * n // 2 for n in powers_of_two(2, most) if 3 * n // 2 < most}
    return tuple(sorted(coarse | ({2} if most > 2 else set()) | midpoints))


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n; a value above the table is a bug of the caller (checked at admission)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class BucketTable:
    """The shapes compiled at start-up: rows per replica, tokens per row, pages per row."""

    batch_sizes: tuple[int, ...]  # rows (the speculative decoder's buckets; the ragged step has max rows)
    chunk_sizes: tuple[int, ...]  # tokens per row of the draft model's prefill
    page_counts: tuple[int, ...]  # (pages per row,): the one page-table width of every step
    # The ragged step's token axis N (`token_ladder`) up to the step's token budget, never below the
    # row count (a step of every row decoding fits).
    token_counts: tuple[int, ...] = ()

    @classmethod
    def build(
        cls, max_num_seqs: int, max_num_batched_tokens: int, max_pages_per_seq: int, ladder: str = "powers-of-two"
    ) -> "BucketTable":
        return cls(
            batch_sizes=powers_of_two(1, max_num_seqs),
            chunk_sizes=powers_of_two(min(16, max_num_batched_tokens), max_num_batched_tokens),
            page_counts=(max_pages_per_seq,),
            token_counts=token_ladder(max(max_num_batched_tokens, max_num_seqs), ladder),
        )

    @property
    def max_rows(self) -> int:
        """Rows of every ragged step (per replica): max_num_seqs."""
        return self.batch_sizes[-1]

    @classmethod
    def for_settings(cls, settings: Any, max_model_len: int, platform: str | None = None) -> "BucketTable":
        """The engine's table: `settings` an EngineConfig, `max_model_len` the resolved one (the setting,
        or the model's max_position_embeddings when it is unset), `platform` jax's backend (needed
        for token_buckets=auto only)."""
        # The budget is the step's, over all its rows: it may exceed max_model_len (many rows, or
        # decodes verifying drafts), though no single prompt chunk can.
        return cls.build(
            settings.max_num_seqs,
            settings.max_num_batched_tokens,
            math.ceil(max_model_len / settings.page_size),
            resolve_token_ladder(settings, platform),
        )


def step_shapes(buckets: BucketTable, num_scheduler_steps: int = 1) -> list[tuple]:
    """Every (tokens, pages) ragged step the engine may run, plus a multi-step variant of each
    decode-sized one (up to the bucket a decode of every row takes: with 2 rows, the 4-token bucket)
    when num_scheduler_steps > 1: one executable per token bucket,
    at the largest page table, on every platform: attention reads only the keys each row sees, so a
    wider page table costs nothing and page-count buckets would only multiply executables.
    """
    plain = [(t, buckets.page_counts[-1]) for t in buckets.token_counts]
    decodes = pick_bucket(buckets.max_rows, buckets.token_counts)
    multi = [s + (MULTI_STEP,) for s in plain if s[0] <= decodes] if num_scheduler_steps > 1 else []
    return plain + multi


def pick_step_shape(
    buckets: BucketTable, num_tokens: int, num_pages: int, ready: tuple[int, ...] | None = None
) -> tuple:
    """The compiled (tokens, pages) step holding `num_tokens` tokens whose longest row has `num_pages`
    pages: the smallest token bucket, at the one page-table width. `ready`: the token buckets usable
    now while the others compile in the background (`opening_buckets`); None: all of them. A step
    larger than every ready bucket (the scheduler's budget is capped to the largest, so none should
    come) takes the table's bucket, compiled then and counted as unplanned."""
    if num_pages > buckets.page_counts[-1]:
        raise ValueError(f"a row of {num_pages} pages exceeds the step's page table ({buckets.page_counts[-1]})")
    if ready is not None and num_tokens <= ready[-1]:
        return pick_bucket(num_tokens, ready), buckets.page_counts[-1]
    return pick_bucket(num_tokens, buckets.token_counts), buckets.page_counts[-1]


def opening_buckets(buckets: BucketTable) -> tuple[int, ...]:
    """The token buckets a start compiling in the background opens with (`compile_in_background`):
    the smallest (a lone decode) and the smallest that holds a decode of every row, which is also
    the step's budget until larger buckets are ready (a longer prompt is chunked to it). Any step
    the scheduler makes then fits one of them, so no request waits for a seat, only for more steps."""
    counts = buckets.token_counts
    return tuple(sorted({counts[0], pick_bucket(buckets.max_rows, counts)}))


def background_order(token_counts: tuple[int, ...], ready: tuple[int, ...]) -> list[int]:
    """The buckets not in `ready`, in the order the background compiles them, largest benefit first.

    First the largest (the step's full token budget: a long prompt then takes few steps instead of
    many small ones); then, each time, the bucket nearest the geometric middle of the widest gap
    (by ratio) between ready buckets, since a step pads to the next ready bucket and the widest gap
    wastes the most: 1, 16 ready of 1..512 gives 512, 64 (or 128), 256, 32, 4, ..."""
    ready_set, left = set(ready), [t for t in token_counts if t not in ready]
    order = []
    if left:
        order.append(left.pop())  # token_counts is sorted: the largest
        ready_set.add(order[-1])
    while left:
        done = sorted(ready_set)
        best = max(left, key=lambda t: _gap(t, done))
        left.remove(best)
        ready_set.add(best)
        order.append(best)
    return order


def _gap(t: int, ready: list[int]) -> tuple[float, float]:
    """(the ratio of the ready buckets around t, t's closeness to their geometric middle)."""
    lo = max((r for r in ready if r < t), default=0.5)
    hi = min((r for r in ready if r > t), default=2 * t)
    return hi / lo, -abs(math.log(t * t / (lo * hi)))


def score_shapes(buckets: BucketTable) -> list[tuple]:
    """One prompt-scoring variant per token bucket (compiled when prompt logprobs are enabled): every
    token's logits, at the largest page table."""
    return [(t, buckets.page_counts[-1], SCORE) for t in buckets.token_counts]


def draft_buckets(k: int, platform: str) -> tuple[int, ...]:
    """Draft counts the adaptive speculation policy prices apart (it times a step of rows verifying
    each count, since a step's token bucket grows with its drafts).

    On a CPU a verify pass costs about proportionally more per position (measured: 2 positions 1.7x,
    7 positions 2.9x a decode step): 1, 2, 4, ... below K, and K. On accelerators a wider verify costs
    about the same as one position, so K alone."""
    if platform != "cpu":
        return (k,)
    counts, c = {k}, 1
    while c < k:
        counts.add(c)
        c *= 2
    return tuple(sorted(counts))


@dataclasses.dataclass(frozen=True)
class ExecutableCounts:
    """How many executables an engine compiles at start-up, by kind."""

    steps: int  # ragged step buckets (tokens, pages); with speculative decoding, speculative steps
    multi_step: int = 0  # num_scheduler_steps > 1
    scoring: int = 0  # enable_prompt_logprobs
    page_copies: int = 0  # the forked pages' copy, per replica and KV cache (the draft's too)

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def describe(self) -> str:
        parts = [
            f"{f.name.replace('_', ' ')} {v}" for f, v in zip(dataclasses.fields(self), dataclasses.astuple(self)) if v
        ]
        return f"{self.total} executables ({', '.join(parts)})"


def executable_counts(
    settings: Any, max_model_len: int | None = None, num_replicas: int | None = None, platform: str | None = None
) -> ExecutableCounts:
    """The executables an engine with `settings` (an EngineConfig) compiles at start-up, from the
    bucket table alone. `max_model_len`: the resolved one when the setting is unset (the model's
    max_position_embeddings); `num_replicas`: the mesh's data axis (mesh_shape[0]); `platform`: jax's
    backend, the one thing the table depends on when token_buckets is auto."""
    max_model_len = settings.max_model_len or max_model_len
    if max_model_len is None:
        raise ValueError("max_model_len is unset in the settings: pass the model's (max_position_embeddings)")
    buckets = BucketTable.for_settings(settings, max_model_len, platform)
    replicas = num_replicas if num_replicas is not None else settings.mesh_shape[0]
    plain = step_shapes(buckets, settings.num_scheduler_steps)
    return ExecutableCounts(
        steps=sum(len(s) == 2 for s in plain),
        multi_step=sum(s[2:] == (MULTI_STEP,) for s in plain),
        scoring=len(score_shapes(buckets)) if settings.enable_prompt_logprobs else 0,
        page_copies=replicas * (2 if settings.speculation == "draft" else 1),
    )
