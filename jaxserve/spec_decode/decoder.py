"""SpeculativeDecoder: the host side of speculative decoding. It decides each sequence's proposals (with
the scheduler, which gives them pages) and how many (the adaptive policy, from measured step times),
packs a speculative step into bucketed arrays, has the runner run it, records what was accepted, and
keeps the draft's cache in step with the target's (draft prefill alongside every target prefill;
catch-up when it fell behind). The runner holds the draft's params and cache and every executable
(`jaxserve.engine.spec_steps`): it lowers, compiles, warms up and calls them, and a multi-host job's
other processes run them too.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.buckets import DRAFT, BucketTable, draft_buckets, pick_bucket
from jaxserve.errors import ConfigError
from jaxserve.kv_cache import PADDING_PAGE, StepBatch
from jaxserve.model.weights import param_bytes
from jaxserve.sampling import RowSampling, SamplingTensors
from jaxserve.spec_decode.ngram import TokenBuffer, propose_ngram
from jaxserve.spec_decode.policy import SpecPolicy, SpecState
from jaxserve.spec_decode.rejection import VerifyOutput
from jaxserve.spec_decode.step import VERIFY, SpecInputs

logger = logging.getLogger(__name__)

CALIBRATION_RUNS = 5  # timed calls of each compiled step when measuring speculation's cost
STEP_TIME_SAMPLES = 16  # the engine's recent step times kept per kind of step (their median is used)
MIN_STEP_TIME_SAMPLES = 3  # fewer than this: the calibrated device time plus the host time seen elsewhere


def load_draft(settings: EngineConfig, mesh: Any, stacked: bool, target_cfg: ModelConfig, tokenizer: Any,
               dtype: Any):
    """Load speculative_model like the model (in its dtype, on its mesh); refuse a different vocabulary."""
    from jaxserve.model_loader import load_model

    path = settings.speculative_model
    draft_cfg = ModelConfig.from_dir(path)
    why = "speculative decoding needs the draft to share the model's tokenizer and vocabulary"
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(f"the draft model {path!r} has a vocabulary of {draft_cfg.vocab_size} tokens and the "
                          f"model {target_cfg.vocab_size}: {why}")
    if tokenizer is not None:
        _check_same_tokenizer(path, tokenizer, why)
    draft_settings = settings.replace(model=path, tokenizer=None, speculative_model=None, num_speculative_tokens=0,
                                      dtype=jnp.dtype(dtype).name)
    return load_model(draft_settings, mesh, stacked=stacked)


def _check_same_tokenizer(path: str, tokenizer: Any, why: str) -> None:
    from jaxserve.tokenizer import load_tokenizer

    try:
        draft_tok = load_tokenizer(path)
    except FileNotFoundError:
        logger.warning("the draft model %s has no tokenizer: assuming the model's (same vocabulary size)", path)
        return
    if len(draft_tok) != len(tokenizer):
        raise ConfigError(f"the draft model's tokenizer ({path}) has {len(draft_tok)} tokens and the model's "
                          f"{len(tokenizer)}: {why}")
    for i in range(len(tokenizer)):
        if draft_tok.id_to_token(i) != tokenizer.id_to_token(i):
            raise ConfigError(f"the draft model's tokenizer ({path}) maps id {i} to {draft_tok.id_to_token(i)!r}, "
                              f"the model's to {tokenizer.id_to_token(i)!r}: {why}")


def draft_kv_bytes_per_token(settings: EngineConfig, dtype: Any) -> int:
    """KV bytes one token takes in the draft's cache (0 without a draft); it shares the target's pages."""
    if settings.speculation != "draft":
        return 0
    return ModelConfig.from_dir(settings.speculative_model).kv_bytes_per_token(jnp.dtype(dtype).itemsize)


@dataclasses.dataclass
class SpecCounters:
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # of them accepted
    verified: int = 0  # (sequence, step) pairs with at least one draft verified
    steps: int = 0  # engine steps run speculatively

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify (accepted drafts + the target's own token)."""
        return (self.accepted + self.verified) / self.verified if self.verified else 0.0


class SpeculativeDecoder:
    """Speculative decoding for one engine: `lookahead` (scheduler hook), `run` (a speculative step),
    `after_step` (keeps the draft's cache in step after plain steps). Device state and executables are
    the runner's (`runner.speculation`, `runner.run_step`)."""

    def __init__(self, settings: EngineConfig, runner: Any, blocks: Any, buckets: BucketTable, max_model_len: int,
                 draft: Any = None):
        self.method = settings.speculation
        self.k = settings.num_speculative_tokens
        self.settings = settings
        self.runner = runner
        self.blocks = blocks
        self.buckets = buckets
        self.max_model_len = max_model_len
        self.num_replicas = runner.num_replicas
        self.draft_buckets = draft_buckets(self.k, jax.default_backend())
        self.counters = SpecCounters()
        self.decode_steps = 0
        # Seconds per decode step: ("plain", batch) and ("spec", batch, drafts). `_device` from timing the
        # compiled steps (calibration), `_wall` the engine's recent whole steps (host work too). A median,
        # not an average: one slow step (a collection, another process on the core) must not price a
        # kind of step so high that the policy never picks, and so never re-measures, it again.
        self._device: dict[tuple, float] = {}
        self._wall: dict[tuple, collections.deque] = {}
        self._wall_median: dict[tuple, float] = {}  # of the kinds with MIN_STEP_TIME_SAMPLES samples or more
        self._timing: tuple | None = None  # what the current engine step is, for record_step_time
        self._untimed = False  # the current step compiled, calibrated or first ran something: not a sample
        # Runner calls that ran an executable for the first time (~15 ms slower on a CPU): no samples.
        self._runner_first_runs = runner.first_runs
        if self.method == "draft":
            if draft is None:
                raise ValueError("the draft method needs the loaded draft model")
            if draft.cfg.max_position_embeddings < max_model_len:
                raise ConfigError(f"the draft model handles {draft.cfg.max_position_embeddings} positions, fewer "
                                  f"than max_model_len={max_model_len}: lower max_model_len")
            logger.info("draft model: %.1f M parameters (the model: %.1f M)", param_bytes(draft.params) / 4e6,
                        param_bytes(runner.params) / 4e6)
        self.speculation = runner.enable_speculation(self.method, self.k, draft if self.method == "draft" else None)
        self.policy = SpecPolicy(self.k, settings.speculative_adaptive)
        logger.info("speculative decoding: %s, %d tokens per step%s (adaptive=%s)", self.method, self.k,
                    f" from {settings.speculative_model}" if draft is not None else "", settings.speculative_adaptive)

    # The draft's model, as the runner holds it (None without a draft; params and cache once closed).
    @property
    def draft_cfg(self) -> ModelConfig | None:
        return self.speculation.draft_cfg

    @property
    def draft_params(self) -> Any:
        return self.speculation.draft_params

    @property
    def draft_cache(self) -> Any:
        return self.speculation.draft_cache

    # ---- per-sequence decisions (called by the scheduler) ------------------------------------------
    @staticmethod
    def state(seq: Any) -> SpecState:
        if seq.spec is None:
            seq.spec = SpecState()
        return seq.spec

    def lookahead(self, seq: Any, batch_size: int) -> int:
        """Draft tokens to propose for `seq` this decode step in a batch of `batch_size` rows, all
        replicas together (the scheduler then gives them pages)."""
        state = self.state(seq)
        # Steps are priced by their per-replica batch bucket; the replicas' rows taken as balanced.
        per_replica = min(-(-batch_size // self.num_replicas), self.buckets.batch_sizes[-1])
        costs = self.costs(per_replica) if self.policy.adaptive else None
        k = min(self.policy.choose(state, self.decode_steps, costs),
                seq.params.max_tokens - len(seq.output_token_ids) - 1,  # k + 1 tokens may be emitted
                self.max_model_len - seq.num_tokens - 1)
        if k <= 0:
            return 0
        if self.method == "ngram":
            if state.tokens is None:
                state.tokens = TokenBuffer()
            tokens = state.tokens.view(seq.prompt_token_ids, seq.output_token_ids)
            state.proposal = propose_ngram(tokens, k, self.settings.prompt_lookup_min, self.settings.prompt_lookup_max)
            return len(state.proposal)
        return k

    # ---- what speculation costs -------------------------------------------------------------------
    def costs(self, batch_size: int) -> list[float]:
        """costs[k]: a step verifying k drafts (its width bucket), in plain decode steps of this batch
        (rows per replica)."""
        B = pick_bucket(batch_size, self.buckets.batch_sizes)
        if ("plain", B) not in self._device:
            self._calibrate(B)
        # Host work per step (the engine around the compiled step), from every kind of step seen so far;
        # a kind not seen yet is estimated as its device time plus that.
        walls = {key: wall for key, wall in self._wall_median.items() if key[1] == B}
        seen = [wall - self._device[key] for key, wall in walls.items() if key in self._device]
        host = max(float(np.median(seen)), 0.0) if seen else 0.0

        def seconds(key):
            return walls.get(key) or self._device[key] + host

        plain = seconds(("plain", B))
        return [1.0] + [seconds(("spec", B, self._bucket(k))) / plain for k in range(1, self.k + 1)]

    def record_step_time(self, seconds: float) -> None:
        """The engine's wall time of the step just run (called for every step)."""
        key, self._timing = self._timing, None
        untimed = self._untimed or self.runner.first_runs != self._runner_first_runs
        self._untimed, self._runner_first_runs = False, self.runner.first_runs
        if key is None or untimed:
            return
        times = self._wall.setdefault(key, collections.deque(maxlen=STEP_TIME_SAMPLES))
        times.append(seconds)
        if len(times) >= MIN_STEP_TIME_SAMPLES:  # once per step here, not per row in costs()
            self._wall_median[key] = float(np.median(times))

    def _bucket(self, drafts: int) -> int:
        return pick_bucket(max(drafts, 1), self.draft_buckets)

    def _calibrate(self, B: int) -> None:
        """Time the compiled plain decode step and the speculative step of every width (all rows on the
        padding page, which no sequence owns). Device time only; the engine's step times replace these
        as steps run."""
        R, P = self.num_replicas, self.buckets.page_counts[0]
        sampling = SamplingTensors.pack([None] * (R * B), (R, B), self.runner.history_len)
        run_plain = self.runner.decode_probe(B)

        def run_spec(d):
            return self.runner.probe((B, P, d, VERIFY), (self._empty_inputs(R, B, P, d).replace(
                num_new=np.full((R, B), d + 1, np.int32), draft_len=np.ones((R, B), np.int32)), sampling))

        self._untimed = True
        self._device[("plain", B)] = _median_seconds(run_plain)
        for d in self.draft_buckets:
            self._device[("spec", B, d)] = _median_seconds(run_spec(d))
        logger.info("speculation at batch %d: plain decode step %.2f ms; speculative step %s", B,
                    self._device[("plain", B)] * 1e3, ", ".join(
                        f"{self._device[('spec', B, d)] * 1e3:.2f} ms with {d} drafts" for d in self.draft_buckets))

    @staticmethod
    def _empty_prefill(R: int, B: int, T: int, P: int) -> StepBatch:
        return StepBatch(tokens=np.zeros((R, B, T), np.int32), start_pos=np.zeros((R, B), np.int32),
                         num_new=np.zeros((R, B), np.int32), page_table=np.full((R, B, P), PADDING_PAGE, np.int32))

    @staticmethod
    def _empty_inputs(R: int, B: int, P: int, d: int) -> SpecInputs:
        def zeros(*shape):
            return np.zeros(shape, np.int32)
        return SpecInputs(last_token=zeros(R, B), pos=zeros(R, B), num_new=zeros(R, B), page_table=zeros(R, B, P),
                          drafts=zeros(R, B, d), draft_tokens=zeros(R, B, 2), draft_start=zeros(R, B),
                          draft_len=zeros(R, B), want_logprobs=np.zeros((R, B), bool))

    # ---- warm-up -----------------------------------------------------------------------------------
    def warm_up(self) -> list[tuple]:
        """Have the runner compile and first-run every speculative executable (`runner.spec_shapes`),
        then time them for the adaptive policy; returns the runner's (shape, seconds) per executable."""
        timings = self.runner.warm_up(self.runner.spec_shapes())
        if self.policy.adaptive:
            for batch in self.buckets.batch_sizes:
                self.costs(batch)
        return timings

    # ---- keeping the draft's cache in step ---------------------------------------------------------
    def after_step(self, kind: str, rows: Sequence[Any], works: Sequence[Any]) -> None:
        """After a plain (non-speculative) step: the draft prefills what the target prefilled; a plain
        decode step leaves the draft one more token behind (caught up before its next proposal)."""
        if kind == "decode":  # priced by the per-replica batch bucket, as run() prices its steps
            per_replica = collections.Counter(row.seq.replica for row in rows)
            self._timing = ("plain", pick_bucket(max(per_replica.values()), self.buckets.batch_sizes))
        else:
            self._timing = None
        if kind == "prefill":
            for row in rows:
                self.state(row.seq).lag = 0
            if self.method == "draft":
                self._draft_prefill([(w.tokens, w.start_pos, w.page_ids, w.replica) for w in works])
        elif kind == "decode":
            self.decode_steps += 1
            if self.method == "draft":
                for row in rows:
                    self.state(row.seq).lag += 1

    def _draft_prefill(self, works: list[tuple[Sequence[int], int, Sequence[int], int]]) -> None:
        """Write (tokens, start, page ids, replica) chunks into the draft's cache, in compiled buckets."""
        R = self.num_replicas
        per_replica = [[w for w in works if w[3] == rep] for rep in range(R)]
        B = pick_bucket(max(len(p) for p in per_replica), self.buckets.batch_sizes)
        T = pick_bucket(max(max(len(w[0]) for w in works), self.buckets.chunk_sizes[0]), self.buckets.chunk_sizes)
        P = self.buckets.page_counts[-1]
        batch = self._empty_prefill(R, B, T, P)
        for rep, rows in enumerate(per_replica):
            for b, (toks, pos, pages, _) in enumerate(rows):
                batch.tokens[rep, b, : len(toks)] = toks
                batch.start_pos[rep, b], batch.num_new[rep, b] = pos, len(toks)
                batch.page_table[rep, b, : len(pages)] = pages
        self.runner.run_step((B, T, P, DRAFT), (batch,))

    def _catch_up(self, rows: Sequence[Any]) -> None:
        """Rows whose draft is 2+ tokens behind (plain decode steps ran without it) catch up to 1 behind:
        every lagging row's next chunk in one draft prefill call per round (one round unless a lag
        exceeds the largest chunk bucket)."""
        limit = self.buckets.chunk_sizes[-1]
        while True:
            works = []
            for row in rows:
                seq, state = row.seq, self.state(row.seq)
                if state.lag < 2:
                    continue
                pos = seq.num_computed
                begin = pos - state.lag
                chunk = seq.tokens[begin : min(pos - 1, begin + limit)]
                works.append((chunk, begin, self.blocks.page_table(seq.seq_id), seq.replica))
                state.lag -= len(chunk)
            if not works:
                return
            rows_per_call = self._rows_per_prefill(works)
            for at in range(0, len(works), rows_per_call):
                self._draft_prefill(works[at : at + rows_per_call])

    def _rows_per_prefill(self, works: list[tuple]) -> int:
        """Rows of these chunks that one compiled draft-prefill bucket takes (see
        `buckets.speculative_shapes`)."""
        b, t = self.buckets.batch_sizes, self.buckets.chunk_sizes
        T = pick_bucket(max(max(len(w[0]) for w in works), t[0]), t)
        return b[-1] if T == t[0] else max([bs for bs in b if bs * T <= t[-1]] or [1])

    # ---- the speculative step ----------------------------------------------------------------------
    def run(self, rows: Sequence[Any]) -> VerifyOutput:
        """One speculative decode step for scheduled decode rows (`row.num_lookahead` drafts each).

        Returns, per row in order, tokens i32[n, d+1] (accepted drafts then the target's token),
        num_accepted i32[n] and their logprobs; updates each sequence's draft lag and acceptance."""
        if self.method == "draft":
            self._catch_up(rows)
        R = self.num_replicas
        per_replica = [[i for i, r in enumerate(rows) if r.seq.replica == rep] for rep in range(R)]
        B = pick_bucket(max(len(p) for p in per_replica), self.buckets.batch_sizes)
        tables = [self.blocks.page_table(r.seq.seq_id) for r in rows]
        P = pick_bucket(max(len(t) for t in tables), self.buckets.page_counts)
        d = self._bucket(max(r.num_lookahead for r in rows))
        inputs = self._empty_inputs(R, B, P, d)
        last_token, pos, num_new, table, drafts = (inputs.last_token, inputs.pos, inputs.num_new, inputs.page_table,
                                                   inputs.drafts)
        draft_tokens, draft_start, draft_len = inputs.draft_tokens, inputs.draft_start, inputs.draft_len
        flat_sampling: list[RowSampling | None] = [None] * (R * B)
        where = np.empty(len(rows), np.int64)
        for rep, indices in enumerate(per_replica):
            for b, i in enumerate(indices):
                row, seq = rows[i], rows[i].seq
                state, k = self.state(seq), rows[i].num_lookahead
                tokens = seq.tokens
                p = seq.num_computed  # the pending token's position
                last_token[rep, b], pos[rep, b], num_new[rep, b] = tokens[p], p, k + 1
                table[rep, b, : len(tables[i])] = tables[i]
                if self.method == "ngram":
                    drafts[rep, b, :k] = state.proposal[:k]
                else:
                    lag = state.lag
                    draft_tokens[rep, b, : lag + 1] = tokens[p - lag : p + 1]
                    draft_start[rep, b], draft_len[rep, b] = p - lag, lag + 1
                inputs.want_logprobs[rep, b] = seq.params.logprobs is not None
                flat_sampling[rep * B + b] = RowSampling.from_params(
                    seq.params, seed=seq.seed, step=len(seq.output_token_ids), prompt_ids=seq.prompt_token_ids,
                    output_ids=seq.output_token_ids)
                where[i] = rep * B + b
        sampling = SamplingTensors.pack(flat_sampling, (R, B), self.runner.history_len)
        self._timing = ("spec", B, d)
        out = self.runner.run_step((B, P, d, VERIFY), (inputs, sampling))
        out = jax.tree.map(lambda x: x.reshape((R * B,) + x.shape[2:])[where], jax.device_get(out))

        self.decode_steps += 1
        self.counters.steps += 1
        for i, row in enumerate(rows):
            state, k, n = self.state(row.seq), row.num_lookahead, int(out.num_accepted[i])
            state.record(k, n)
            if k > 0:
                self.counters.proposed += k
                self.counters.accepted += n
                self.counters.verified += 1
            if self.method == "draft":
                state.lag = 1 if 0 < k == n else 0  # a fully accepted run: the draft never fed its last draft
        return out

    def close(self) -> None:
        """Forget the measured step times. The executables and the draft's params and cache are the
        runner's, released by its close()."""
        self._device.clear()
        self._wall.clear()
        self._wall_median.clear()

    # ---- observability -------------------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.counters
        return dict(
            spec_decode_num_draft_tokens=c.proposed,
            spec_decode_num_accepted_tokens=c.accepted,
            spec_decode_num_verify_steps=c.verified,
            spec_decode_num_steps=c.steps,
            spec_decode_acceptance_rate=c.acceptance_rate,
            spec_decode_mean_accepted_length=c.mean_accepted_length,
        )


def _median_seconds(run, repeats: int = CALIBRATION_RUNS) -> float:
    jax.block_until_ready(run())  # the first call may compile, or page in buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return float(np.median(times))
