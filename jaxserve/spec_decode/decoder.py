"""SpeculativeDecoder: the host side of speculative decoding. It decides each sequence's proposals (with
the scheduler, which gives them pages) and how many (the adaptive policy, from measured step times),
gives a step's decode rows their drafts and the draft model the tokens its cache lacks, and records
what was accepted. Every step of a speculative engine is one speculative ragged step
(`jaxserve.spec_decode.step`: prompt chunks, plain decodes and verifications together, the draft
model's catch-up and proposals inside); the runner holds the draft's params and cache and every
executable (`jaxserve.runner.speculative`), and a multi-host job's other processes run them too.

Async scheduling: a step in which no row drafts emits one token per sampling row, so the host knows
everything about it at dispatch but the tokens, which the next step takes on the device like a
plain step's (placeholders). Such a step overlaps the next one, for every method. A step that drafts
needs its rows' last tokens on the host (n-gram proposals read them; acceptance decides where
every row goes next), so the step before it is processed first (`may_draft`), and the drafting step
is processed before the next is scheduled: a row whose last token is still in flight never drafts
(`lookahead`), whatever the guess said.
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
from jaxserve.engine.buckets import BucketTable, draft_buckets, pick_bucket
from jaxserve.engine.step_stats import is_prompt_chunk
from jaxserve.errors import ConfigError
from jaxserve.model.kv_cache import PADDING_PAGE
from jaxserve.model.weights import param_bytes
from jaxserve.spec_decode.ngram import TokenBuffer, propose_ngram
from jaxserve.spec_decode.policy import AcceptanceEstimate, SpecPolicy, SpecState

logger = logging.getLogger(__name__)

CALIBRATION_RUNS = 5  # timed calls of each compiled step when measuring speculation's cost
STEP_TIME_SAMPLES = 16  # the engine's recent step times kept per kind of step (their median is used)
MIN_STEP_TIME_SAMPLES = 3  # fewer than this: the calibrated device time plus the host time seen elsewhere


def load_draft(settings: EngineConfig, mesh: Any, stacked: bool, target_cfg: ModelConfig, tokenizer: Any, dtype: Any):
    """Load speculative_model like the model (in its dtype, on its mesh); refuse a different vocabulary."""
    from jaxserve.loading.model_loader import load_model

    path = settings.speculative_model
    draft_cfg = ModelConfig.from_dir(path)
    why = "speculative decoding needs the draft to share the model's tokenizer and vocabulary"
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(
            f"the draft model {path!r} has a vocabulary of {draft_cfg.vocab_size} tokens and the "
            f"model {target_cfg.vocab_size}: {why}"
        )
    if tokenizer is not None:
        _check_same_tokenizer(path, tokenizer, why)
    draft_settings = settings.replace(
        model=path, tokenizer=None, speculative_model=None, num_speculative_tokens=0, dtype=jnp.dtype(dtype).name
    )
    return load_model(draft_settings, mesh, stacked=stacked)


@dataclasses.dataclass
class LoadedHead:
    """An EAGLE-3 head on the devices: what `runner.enable_speculation` takes for method eagle3."""

    params: Any  # model.eagle3.Eagle3Params, replicated over the mesh
    cfg: Any  # model.eagle3.Eagle3Config
    dtype: Any


def load_eagle3_head(settings: EngineConfig, mesh: Any, target_cfg: ModelConfig, dtype: Any) -> LoadedHead:
    """The EAGLE-3 head in speculative_model (speculators format), in the model's dtype, replicated on
    its mesh; refused when it was trained for another model (vocabulary, state width, depth)."""
    from jaxserve.loading.eagle3_checkpoint import load_eagle3

    cfg, host = load_eagle3(settings.speculative_model, target_cfg, jnp.dtype(dtype))
    where = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.tree.map(lambda x: jax.device_put(x, where), host)
    return LoadedHead(params=params, cfg=cfg, dtype=jnp.dtype(dtype))


def _check_same_tokenizer(path: str, tokenizer: Any, why: str) -> None:
    from jaxserve.loading.tokenizer import load_tokenizer

    try:
        draft_tok = load_tokenizer(path)
    except FileNotFoundError:
        logger.warning("the draft model %s has no tokenizer: assuming the model's (same vocabulary size)", path)
        return
    if len(draft_tok) != len(tokenizer):
        raise ConfigError(
            f"the draft model's tokenizer ({path}) has {len(draft_tok)} tokens and the model's {len(tokenizer)}: {why}"
        )
    for i in range(len(tokenizer)):
        if draft_tok.id_to_token(i) != tokenizer.id_to_token(i):
            raise ConfigError(
                f"the draft model's tokenizer ({path}) maps id {i} to {draft_tok.id_to_token(i)!r}, "
                f"the model's to {tokenizer.id_to_token(i)!r}: {why}"
            )


def draft_kv_bytes_per_token(settings: EngineConfig, dtype: Any) -> int:
    """KV bytes one token takes in the draft's cache (0 without a draft); it shares the target's pages."""
    if settings.speculation == "eagle3":  # the head's one layer, and the model's fused states it drafts from
        from jaxserve.loading.eagle3_checkpoint import read_config

        head = read_config(settings.speculative_model, ModelConfig.from_dir(settings.model))
        itemsize = jnp.dtype(dtype).itemsize
        return head.layer.kv_bytes_per_token(itemsize) + head.hidden_size * itemsize
    if settings.speculation != "draft":
        return 0
    return ModelConfig.from_dir(settings.speculative_model).kv_bytes_per_token(jnp.dtype(dtype).itemsize)


@dataclasses.dataclass
class SpecCounters:
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # of them accepted
    verified: int = 0  # (sequence, step) pairs with at least one draft verified
    steps: int = 0  # engine steps run speculatively
    off_steps: int = 0  # steps of more than one row in which the batch decision let no row draft
    # By draft position j (0: the first draft): verifies that proposed a draft there, and those whose
    # draft there was accepted (vLLM's spec_decode_num_accepted_tokens_per_pos).
    proposed_per_pos: list[int] = dataclasses.field(default_factory=list)
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def record(self, k: int, n: int) -> None:
        """One verify of k drafts, n of them accepted."""
        grow = k - len(self.proposed_per_pos)
        if grow > 0:
            self.proposed_per_pos.extend([0] * grow)
            self.accepted_per_pos.extend([0] * grow)
        for j in range(k):
            self.proposed_per_pos[j] += 1
            self.accepted_per_pos[j] += j < n

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify (accepted drafts + the target's own token)."""
        return (self.accepted + self.verified) / self.verified if self.verified else 0.0


class SpeculativeDecoder:
    """Speculative decoding for one engine: `lookahead` (scheduler hook), `prepare` (a step's drafts)
    and `record` (its acceptance). Device state and executables are the runner's (`runner.speculation`,
    `runner.run_step`)."""

    def __init__(
        self,
        settings: EngineConfig,
        runner: Any,
        blocks: Any,
        buckets: BucketTable,
        max_model_len: int,
        draft: Any = None,
    ):
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
        # Engine-wide acceptance (the batch decision; a new request's prior), and the batch decision
        # of this step: (decode_steps, per-replica batch) -> drafts allowed; the last one logged per batch.
        self.acceptance = AcceptanceEstimate()
        self._batch_decision: tuple[tuple[int, int], bool] | None = None
        self._counted_decision: tuple[int, int] | None = None  # the last batch decision counted in off_steps
        self._logged_decision: dict[int, bool] = {}
        self._costs_at: tuple[tuple[int, int], list[float]] | None = None  # _step_costs of this step
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
                raise ConfigError(
                    f"the draft model handles {draft.cfg.max_position_embeddings} positions, fewer "
                    f"than max_model_len={max_model_len}: lower max_model_len"
                )
            logger.info(
                "draft model: %.1f M parameters (the model: %.1f M)",
                param_bytes(draft.params) / 4e6,
                param_bytes(runner.params) / 4e6,
            )
        if self.method == "eagle3":
            if draft is None:
                raise ValueError("the eagle3 method needs the loaded head")
            logger.info(
                "EAGLE-3 head: %.1f M parameters (%.1f MiB), draft vocabulary %d, aux layers %s",
                sum(x.size for x in jax.tree.leaves(draft.params)) / 1e6,
                param_bytes(draft.params) / 2**20,
                draft.cfg.draft_vocab_size,
                list(draft.cfg.aux_layers),
            )
        self.speculation = runner.enable_speculation(
            self.method, self.k, draft if self.method in ("draft", "eagle3") else None
        )
        self.policy = SpecPolicy(self.k, settings.speculative_adaptive)
        logger.info(
            "speculative decoding: %s, %d tokens per step%s (adaptive=%s)",
            self.method,
            self.k,
            f" from {settings.speculative_model}" if draft is not None else "",
            settings.speculative_adaptive,
        )

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
    def state(self, seq: Any) -> SpecState:
        if seq.spec is None:  # a new request: its estimate starts from the engine's
            seq.spec = self.acceptance.new_state()
        return seq.spec

    def lookahead(self, seq: Any, batch_size: int) -> int:
        """Draft tokens to propose for `seq` this decode step in a batch of `batch_size` rows, all
        replicas together (the scheduler then gives them pages)."""
        state = self.state(seq)
        per_replica = self._per_replica(batch_size)  # steps are priced by their per-replica batch bucket
        costs = self._step_costs(per_replica) if self.policy.adaptive else None
        if costs is not None and per_replica > 1:
            drafts = self._batch_drafts(per_replica, costs)
            if self._counted_decision != (self.decode_steps, per_replica):
                self._counted_decision = (self.decode_steps, per_replica)
                self.counters.off_steps += not drafts
            if not drafts:
                return 0
        if seq.in_flight:  # its last token is still on the device (async scheduling): nothing to draft from
            return 0
        k = min(
            self.policy.choose(state, self.decode_steps, costs),
            seq.params.max_tokens - len(seq.output_token_ids) - 1,  # k + 1 tokens may be emitted
            self.max_model_len - seq.num_tokens - 1,
        )
        if k <= 0:
            return 0
        if self.method == "ngram":
            if state.tokens is None:
                state.tokens = TokenBuffer()
            tokens = state.tokens.view(seq.prompt_token_ids, seq.output_token_ids)
            state.proposal = propose_ngram(tokens, k, self.settings.prompt_lookup_min, self.settings.prompt_lookup_max)
            return len(state.proposal)
        return k

    def may_draft(self, running: Sequence[Any]) -> bool:
        """Whether the next step, not scheduled yet, may give a row of `running` (the scheduler's running
        sequences) drafts: the overlap wrapper then processes the step in flight first, so that the
        rows draft from their last tokens. The batch decision is made here for the step (its rows ask
        again and get the same answer); a guess where the answer needs the tokens in flight (n-gram
        proposals) or the scheduled batch. A wrong guess costs time, never exactness: `lookahead`
        gives no row drafts while its last token is in flight."""
        decoding = [seq for seq in running if seq.compute_target - seq.num_computed == 1]
        if not decoding:
            return False
        if not self.policy.adaptive:
            return True
        per_replica = self._per_replica(len(decoding))
        costs = self._step_costs(per_replica)
        if per_replica > 1:
            return self._batch_drafts(per_replica, costs)
        return any(self.policy.choose(self.state(seq), self.decode_steps, costs) > 0 for seq in decoding)

    def _per_replica(self, batch_size: int) -> int:
        """The per-replica batch a step of `batch_size` decode rows is priced at: the replicas' rows
        taken as balanced, at most the largest batch bucket."""
        return min(-(-batch_size // self.num_replicas), self.buckets.batch_sizes[-1])

    def _batch_drafts(self, batch: int, costs: list[float]) -> bool:
        """The batch decision (`SpecPolicy.batch_drafts`), made once per step (for `may_draft` or its
        first row); a change is logged. `lookahead` counts each step it turns speculation off (off_steps)."""
        key = (self.decode_steps, batch)
        if self._batch_decision is not None and self._batch_decision[0] == key:
            return self._batch_decision[1]
        drafts = self.policy.batch_drafts(self.acceptance, self.decode_steps, costs)
        self._batch_decision = (key, drafts)
        B = pick_bucket(batch, self.buckets.batch_sizes)
        pays = self.policy.best(self.acceptance.value, costs) > 0
        if self._logged_decision.get(B, True) != pays:
            self._logged_decision[B] = pays
            logger.info(
                "speculation at batch %d: %s (engine-wide acceptance %.2f; a step verifying k drafts costs %s "
                "plain steps)",
                B,
                "on" if pays else "off but for probes",
                self.acceptance.value,
                "/".join(f"{c:.2f}" for c in costs[1:]),
            )
        return drafts

    # ---- what speculation costs -------------------------------------------------------------------
    def _step_costs(self, batch_size: int) -> list[float]:
        """`costs`, computed once per engine step and batch (every row of the step asks for them)."""
        key = (self.decode_steps, batch_size)
        if self._costs_at is None or self._costs_at[0] != key:
            self._costs_at = (key, self.costs(batch_size))
        return self._costs_at[1]

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
        """Time the compiled step of B plain decode rows and of B rows verifying d drafts, for every
        width d (all rows on the padding page, which no sequence owns). Device time only; the engine's
        step times replace these as steps run. A width whose rows do not fit the token budget costs
        infinity (the policy never picks it)."""
        self._untimed = True
        # A step may be in flight (async scheduling): the probes must not replace the samples its
        # placeholders name. Not donated, so the array is still whole after them.
        carried = self.runner.carried
        self._device[("plain", B)] = _median_seconds(self.runner.probe_rows(self._probe_rows(B, 0)))
        for d in self.draft_buckets:
            fits = B * (d + 1) <= self.buckets.token_counts[-1]
            self._device[("spec", B, d)] = (
                _median_seconds(self.runner.probe_rows(self._probe_rows(B, d))) if fits else float("inf")
            )
        self.runner.carried = carried
        logger.info(
            "speculation at batch %d: plain decode step %.2f ms; speculative step %s",
            B,
            self._device[("plain", B)] * 1e3,
            ", ".join(f"{self._device[('spec', B, d)] * 1e3:.2f} ms with {d} drafts" for d in self.draft_buckets),
        )

    def _probe_rows(self, batch: int, drafts: int) -> list:
        """`batch` rows of each replica on the padding page, each verifying `drafts` drafts."""
        from jaxserve.runner.step_row import StepRow

        pages = [PADDING_PAGE] * -(-(drafts + 1) // self.blocks.page_size)
        return [
            StepRow([0] * (drafts + 1), 0, pages, replica=rep, num_drafts=drafts, draft_tokens=[0])
            for rep in range(self.num_replicas)
            for _ in range(batch)
        ]

    # ---- warm-up -----------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Time the steps for the adaptive policy (the runner's warm-up compiled them: a speculative
        engine's ragged steps are its speculative ones)."""
        if self.policy.adaptive:
            for batch in self.buckets.batch_sizes:
                self.costs(batch)

    # ---- the speculative step ----------------------------------------------------------------------
    def dispatch(self, scheduled: Sequence[Any], updates: Sequence[Any]) -> bool:
        """A step about to be dispatched (`updates`: the batch update's rows): its rows' drafts
        (`prepare`); returns whether it verifies drafts. One that does not is recorded now (no row
        accepts anything, so its acceptance is known before it runs), and the engine treats it as a
        plain step: its tokens take placeholders and the next step may be scheduled at once. A step
        scoring prompt tokens (the plain scoring variant runs it) drafts nothing and is not recorded."""
        if any(row.scores_prompt for row in scheduled):
            self._timing = None
            return False
        self.prepare(scheduled, updates)
        if any(row.num_lookahead for row in scheduled):
            return True
        self.record(scheduled, np.zeros(len(scheduled), np.int32))
        return False

    def prepare(self, scheduled: Sequence[Any], updates: Sequence[Any]) -> None:
        """Give each decode row of a step (`updates`: the batch update's rows, in the same order) its
        drafts (`row.num_lookahead`: the host's n-gram proposal, or zeros the draft model fills in the
        step) and, for the draft model, its lag (how many tokens the draft's cache lacks). Notes
        what the step is, for its timing."""
        verifying = False
        for row, update in zip(scheduled, updates):
            if is_prompt_chunk(row):
                continue
            seq, k = row.seq, row.num_lookahead
            update.drafts = (self.state(seq).proposal[:k] if self.method == "ngram" else [0] * k) if k else []
            verifying |= k > 0
            if self.method == "draft":
                update.draft_lag = self.state(seq).lag
        decodes = [row for row in scheduled if not is_prompt_chunk(row)]
        self._timing = None
        if decodes and len(decodes) == len(scheduled):  # decode-only steps are priced per batch bucket
            per_replica = collections.Counter(row.seq.replica for row in decodes)
            B = pick_bucket(max(per_replica.values()), self.buckets.batch_sizes)
            width = max(row.num_lookahead for row in decodes)
            self._timing = ("spec", B, self._bucket(width)) if verifying else ("plain", B)

    def record(self, scheduled: Sequence[Any], num_accepted: np.ndarray) -> None:
        """After a speculative step: each row's acceptance and the draft's lag (0 after a prompt chunk,
        whose tokens the draft took too; 1 after a fully accepted run, whose last draft it never fed;
        unchanged by a plain decode, which feeds the draft one token as the target takes one)."""
        self.decode_steps += 1
        self.counters.steps += any(row.num_lookahead for row in scheduled)
        for row, n in zip(scheduled, num_accepted):
            state, k, n = self.state(row.seq), row.num_lookahead, int(n)
            if is_prompt_chunk(row):
                state.lag = 0
                continue
            state.record(k, n)
            self.acceptance.record(k, n)
            if k > 0:
                self.counters.record(k, n)
                self.counters.proposed += k
                self.counters.accepted += n
                self.counters.verified += 1
                state.lag = 1 if self.method == "draft" and k == n else 0

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
            spec_decode_num_off_steps=c.off_steps,
            spec_decode_acceptance_rate=c.acceptance_rate,
            spec_decode_mean_accepted_length=c.mean_accepted_length,
            spec_decode_num_drafts_per_pos=list(c.proposed_per_pos),
            spec_decode_num_accepted_tokens_per_pos=list(c.accepted_per_pos),
        )


def _median_seconds(run, repeats: int = CALIBRATION_RUNS) -> float:
    jax.block_until_ready(run())  # the first call may compile, or page in buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return float(np.median(times))
