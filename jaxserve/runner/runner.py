"""The model runner: packs scheduled rows into one ragged step, calls its executable, fetches samples.

It is the only place where host state becomes device arrays, and the one owner of executables. A
step is a flat axis of `N` tokens per replica (`jaxserve.model.ragged`): decodes, prompt chunks and their
mix in one call. Each (tokens, pages) bucket of `buckets.step_shapes` is compiled once ahead of time;
the cache is donated into every call and replaced by the result. With speculative decoding every
bucket is compiled from the speculative step instead (`spec_steps`: verifications among the rows,
the draft model inside), and the runner also holds the draft's params and cache; `jaxserve.spec_decode`
decides each row's drafts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine import buckets as bucket_shapes
from jaxserve.engine.buckets import MULTI_STEP, SCORE, BucketTable, pick_step_shape
from jaxserve.runner import speculative as spec_steps
from jaxserve.runner.compilation import CompileCounter, step_compiler_options
from jaxserve.runner.input_batch import StepWriter
from jaxserve.errors import EngineClosedError
from jaxserve.model.kv_cache import KVCache, RaggedBatch, cache_shardings, copy_pages_padded
from jaxserve.model.weights import Params
from jaxserve.model.placeholders import carry_tokens, resolve
from jaxserve.model.ragged import PAD_SLOT, RaggedRow, pack_ragged
from jaxserve.model.sampler import MAX_LOGPROBS, RowSampling, SampleOutput, SamplingTensors, sample
from jaxserve.model.sharding import per_replica
from jaxserve.steps import StepOptions, ragged_step
from jaxserve.structured.apply import TokenMask, mask_logits
from jaxserve.model.transfer import SPARSE_FIELDS, Layout, from_buffer, with_sparse

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RowWork:
    """One sequence's share of a step: compute `tokens` starting at `start_pos`; sample one token
    after them unless `samples` is False (a prompt chunk that does not end its prompt)."""

    tokens: Sequence[int]
    start_pos: int
    page_ids: Sequence[int]
    sampling: RowSampling | None = None  # None: greedy
    replica: int = 0
    # With prompt logprobs: the token after each of `tokens` (what its logits are scored against).
    targets: Sequence[int] | None = None
    samples: bool = True
    # Structured output: the sequence's GrammarMatcher (jaxserve.structured), whose mask constrains
    # this row's sample; None: unconstrained.
    grammar: Any = None
    step: int | None = None  # the output index this row samples, in place of sampling.step
    # Speculative decoding: the last `num_drafts` of `tokens` are drafts to verify (zeros where the
    # draft model proposes them in the step), and the tokens the draft model's cache lacks, ending
    # at this row's last token before the drafts, from position `draft_start` (None: the row's own).
    num_drafts: int = 0
    draft_tokens: Sequence[int] | None = None
    draft_start: int = 0
    want_logprobs: bool = False  # speculative steps: the row returns logprobs (computed only if one does)
    # With `page_ids` the block manager's live table (`BlockManager.live_page_ids`): its version. The
    # same table object at the same version holds the same leading entries, so a step whose row holds
    # it again does not rewrite them (`StepWriter`); None: rewritten every step.
    pages_version: int | None = None


def _take_carried(batch: RaggedBatch, sampling: SamplingTensors, carried: jax.Array):
    """The step's inputs with every placeholder (`jaxserve.model.placeholders`: a token the previous step
    sampled, not yet on the host) replaced by that step's carried token: in the tokens computed and
    in the penalty histories."""
    return (batch.replace(tokens=resolve(batch.tokens, carried)),
            sampling.replace(history=resolve(sampling.history, carried)))


def _carry(tokens: jax.Array, carried: jax.Array, carry_sharding=None) -> jax.Array:
    """The tokens the next step's placeholders name: this step's samples i32[R, L] at carried's width."""
    out = carry_tokens(tokens, carried.shape[-1])
    return out if carry_sharding is None else jax.lax.with_sharding_constraint(out, carry_sharding)


def _forward_and_sample(params, cache, batch, sampling, mask, cfg, options, cache_sharding=None):
    """The forward of a step whose inputs are whole (placeholders resolved), then a sample per row
    that samples: (samples [R, L], cache)."""
    logits, cache = ragged_step(params, cache, batch, cfg, options)  # f32[R, L, V]
    if cache_sharding is not None:  # keep the donated cache's layout stable from step to step
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding)
    return sample_per_replica(logits, mask, sampling, options.mesh), cache


def sample_per_replica(logits, mask, sampling, mesh):
    """`sample` of logits [R, L, V] under their grammar masks, each replica's rows on its own devices
    (`sharding.per_replica`). Masks first, so every sampler transform (and the logprobs) sees only
    allowed tokens. Top logprobs under a cond inside `sample` (only steps where a row asks pay for
    the top-k): one executable, where a second compiled variant per bucket would double start-up."""
    return per_replica(lambda x, m, st: sample(mask_logits(x, m), st, want_logprobs=MAX_LOGPROBS), mesh)(
        logits, mask, sampling)


def _generate_step(params, cache, carried, sparse, batch, sampling, mask, cfg, options, cache_sharding=None,
                   out_sharding=None, carry_sharding=None):
    """One ragged step: the forward, then a sample per row that samples. `carried` i32[R, S]: the
    previous step's samples (what placeholders name); `sparse`: the SPARSE_FIELDS of `sampling`;
    returns (samples [R, L], cache, carried)."""
    batch, sampling = _take_carried(batch, with_sparse(sampling, sparse), carried)
    out, cache = _forward_and_sample(params, cache, batch, sampling, mask, cfg, options, cache_sharding)
    if out_sharding is not None:  # multi-host: every process reads its own full copy of the samples
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out, cache, _carry(out.tokens, carried, carry_sharding)


# The compiled steps take (params, cache, carried tokens, packed inputs): see jaxserve.model.transfer.
_STATIC = ("layout", "cfg", "options", "cache_sharding", "out_sharding", "carry_sharding")
_generate_step_jit = jax.jit(from_buffer(_generate_step, 4), static_argnames=_STATIC, donate_argnums=(1,))


def _next_decode_batch(batch: RaggedBatch, tokens: jax.Array, active: jax.Array, page_size: int) -> RaggedBatch:
    """The next decode step of a pure-decode batch (row r's one token at index r, its logit r): each
    active row feeds the token it sampled at the next position; inactive rows write nothing."""
    S = batch.context_lens.shape[-1]
    row = jnp.minimum(batch.token_row, S - 1)  # padding tokens: any row, masked below
    take = jax.vmap(lambda x, i: x[i])
    tok_active = take(active, row) & (batch.token_row < S)  # bool[R, N]
    positions = batch.positions + tok_active
    pages = take(batch.page_table, row)  # i32[R, N, P]: each token's row's page table
    last = pages.shape[-1] - 1  # an inactive token's position may pass its table: clamped, then dropped
    page = jnp.take_along_axis(pages, jnp.minimum(positions // page_size, last)[..., None], -1)[..., 0]
    slots = jnp.where(tok_active, page * page_size + positions % page_size, PAD_SLOT)
    next_tokens = jnp.where(tok_active, take(tokens, jnp.minimum(row, tokens.shape[-1] - 1)), batch.tokens)
    return batch.replace(tokens=next_tokens.astype(jnp.int32), positions=positions, slots=slots,
                         context_lens=batch.context_lens + active)


def _multi_decode_step(params, cache, carried, sparse, batch, sampling, mask, steps, cfg, options, num_steps,
                       page_size, cache_sharding=None, out_sharding=None, carry_sharding=None):
    """`num_steps` decode steps in one call (num_scheduler_steps): each feeds the token it sampled to
    the next, so the host is not needed in between. Row r takes part in its first steps[r] steps and
    writes nothing after (its pages beyond those are not its own). Samples: [num_steps, R, L, ...].
    The grammar masks hold for the first step only: the engine gives constrained rows one step.
    Multi-step engines run serially (no step follows this one before its samples are on the host),
    so `carried` is passed through unchanged."""
    batch, sampling = _take_carried(batch, with_sparse(sampling, sparse), carried)

    def one(carry, k):
        cache, batch, sampling = carry
        now = mask.replace(constrained=mask.constrained & (k == 0))
        out, cache = _forward_and_sample(params, cache, batch, sampling, now, cfg, options, cache_sharding)
        batch = _next_decode_batch(batch, out.tokens, k + 1 < steps, page_size)
        return (cache, batch, sampling.advanced(out.tokens)), out

    (cache, _, _), out = jax.lax.scan(one, (cache, batch, sampling), jnp.arange(num_steps, dtype=jnp.int32))
    if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out, cache, carried


_multi_decode_step_jit = jax.jit(from_buffer(_multi_decode_step, 4),
                                 static_argnames=_STATIC + ("num_steps", "page_size"), donate_argnums=(1,))


@flax.struct.dataclass
class PromptScores:
    """Per chunk token t: the logprob of the token after it (`targets[t]`) and the top-N alternatives."""

    target_logprobs: jax.Array  # f32[..., T]
    top_ids: jax.Array  # i32[..., T, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[..., T, MAX_LOGPROBS]


def _score_step(params, cache, carried, sparse, batch, sampling, mask, sample_index, targets, cfg, options,
                cache_sharding=None, out_sharding=None, carry_sharding=None):
    """A step that also scores every token (prompt_logprobs): `batch.logit_index` lists all N tokens,
    `sample_index` i32[R, L] the ones that sample."""
    batch, sampling = _take_carried(batch, with_sparse(sampling, sparse), carried)
    logits, cache = ragged_step(params, cache, batch, cfg, options)  # f32[R, N, V]
    if cache_sharding is not None:
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding)
    sampled = sample_per_replica(jnp.take_along_axis(logits, sample_index[..., None], axis=1), mask, sampling,
                                 options.mesh)
    logp = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logp, MAX_LOGPROBS)
    target = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    out = (sampled, PromptScores(target, top_ids, top_logprobs))
    if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out, cache, _carry(sampled.tokens, carried, carry_sharding)


_score_step_jit = jax.jit(from_buffer(_score_step, 4), static_argnames=_STATIC, donate_argnums=(1,))


@dataclasses.dataclass
class PackedRows:
    """Rows laid out in one ragged step, and where each row's sample and tokens landed."""

    shape: tuple  # (tokens, pages)
    batch: RaggedBatch  # numpy, leading R
    sampling: SamplingTensors  # [R, L]
    mask: TokenMask  # numpy [R, L]: the constrained rows' grammar masks
    logit_at: np.ndarray  # each row's flat index in [R * L] (its sample); -1 for rows that do not sample
    token_at: list[tuple[int, int, int]]  # each row's (replica, first token, tokens)
    score_inputs: tuple[np.ndarray, np.ndarray] | None = None  # scoring: (sample index [R, L], targets [R, N])
    # A plain step written by its bucket's StepWriter: the packed buffer (what Layout.pack makes of
    # batch, sampling and mask), which batch, sampling and mask are views of until the bucket's next step.
    buffer: np.ndarray | None = None
    speculative: tuple | None = None  # a speculative step's (SpecRows, DraftInputs | None): spec_steps.pack

    @property
    def inputs(self) -> tuple:
        """The step's host inputs, as `ModelRunner.run_step` takes them."""
        if self.speculative is not None:
            return (self.batch, self.sampling, *self.speculative)
        return (self.batch, self.sampling, self.mask)

    def unpack(self, x: np.ndarray) -> np.ndarray:  # x: [R, L, ...] -> [rows, ...]
        return x.reshape((-1,) + x.shape[2:])[np.maximum(self.logit_at, 0)]

    def sample_slot(self, i: int) -> int:
        """Row i's sample's index among its replica's samples (what a placeholder of it names)."""
        return int(self.logit_at[i]) % self.sampling.temperature.shape[1]

    def sample_slots(self) -> list[int]:
        """`sample_slot` of every row, as a list (meaningless for rows that do not sample)."""
        L = self.sampling.temperature.shape[1]
        return [at % L for at in self.logit_at.tolist()]


def split_sparse(inputs: tuple) -> tuple[tuple, tuple]:
    """A step's host inputs (RaggedBatch, SamplingTensors, TokenMask, ...) as (the packed part: the
    sampling's SPARSE_FIELDS taken out, those fields); arrays or ShapeDtypeStructs alike."""
    batch, sampling, *rest = inputs
    fields = tuple(getattr(sampling, name) for name in SPARSE_FIELDS)
    return (batch, sampling.replace(**{name: None for name in SPARSE_FIELDS}), *rest), fields


class PendingSamples:
    """A dispatched step's samples on their way to the host (the copy starts at dispatch): the
    engine schedules and dispatches the next step before it asks for them. Without `logprobs` only
    the tokens come back (the samples' logprobs and top-N stay on the device): each array fetched
    costs the host ~15-30 us a step, as long as the rest of a batch-1 step's fetch. `start_copy`
    False (a CPU device, whose arrays NumPy reads in place, without a copy): no copy is started,
    which only cost the host ~7 us an array there."""

    def __init__(self, out: Any, packed: PackedRows, logprobs: bool = True, start_copy: bool = True):
        self.packed = packed
        # A plain step of which no row asked for logprobs: its tokens alone, one array and no pytree.
        self._tokens_only = not logprobs and not isinstance(out, tuple)
        if self._tokens_only:
            self._out = out.tokens
            if start_copy:
                self._out.copy_to_host_async()
            return
        if not logprobs:
            out = (out[0].replace(logprobs=None, top_ids=None, top_logprobs=None), out[1])
        self._out = out
        if start_copy:
            for leaf in jax.tree.leaves(out):
                leaf.copy_to_host_async()

    def is_ready(self) -> bool:
        """Whether the step is done (its samples computed), without waiting for it."""
        return all(leaf.is_ready() for leaf in jax.tree.leaves(self._out))

    def wait(self) -> None:
        """Wait until the step is done, fetching nothing."""
        jax.block_until_ready(self._out)

    def result(self) -> SampleOutput | tuple[SampleOutput, "PromptScores"]:
        """Each row's sample in row order, as `ModelRunner.execute` returns them (waits for the step)."""
        packed = self.packed
        if self._tokens_only:
            return SampleOutput(packed.unpack(jax.device_get(self._out)), None, None, None)
        out = jax.device_get(self._out)
        if packed.score_inputs is None:
            return jax.tree.map(packed.unpack, out)
        sampled, scores = out
        width = max(n for _, _, n in packed.token_at)
        index = np.asarray([[min(t + j, t + n - 1) for j in range(width)] for _, t, n in packed.token_at])
        replica = np.asarray([rep for rep, _, _ in packed.token_at])[:, None]
        return jax.tree.map(packed.unpack, sampled), jax.tree.map(lambda x: x[replica, index], scores)


class ModelRunner:
    """Owns params and the KV cache; runs one bucketed step at a time."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        cache: KVCache,
        buckets: BucketTable,
        options: StepOptions = StepOptions(),
        shardings: Any = None,
        num_scheduler_steps: int = 1,
    ):
        self.cfg = cfg
        self.params = params
        self.cache = cache
        self.buckets = buckets
        self.options = options
        self.shardings = shardings  # jaxserve.model.sharding.Shardings or None
        self.num_replicas = cache.num_replicas
        self.num_scheduler_steps = num_scheduler_steps  # > 1: decode buckets get a multi-step variant
        # Every executable: (tokens, pages) or (..., "score" | "multi-step"); with speculative decoding
        # the (tokens, pages) ones are speculative steps (jaxserve.runner.speculative).
        self._executables: dict[tuple, Any] = {}
        self._layouts: dict[tuple, Layout] = {}  # how each bucket's inputs are packed
        self._idle: dict[int, tuple] = {}  # per L: the sparse sampling inputs of steps that use none
        self._idle_host: dict[int, tuple] = {}  # the same on the host (what the step's inputs hold)
        self._writers: dict[tuple, StepWriter] = {}  # per plain bucket: its inputs, kept and rewritten
        # Per plain bucket: the copies of its writer's buffer handed to calls, each with an output of
        # the step that read it (None: not yet called), reused once that output is ready (`_stage`).
        self._staged: dict[tuple, list[list[Any]]] = {}
        self.last_sparse: tuple | None = None  # the last step's sparse sampling inputs (benchmarks reuse them)
        self.unplanned_compiles = 0  # shapes that were not in the warmed table
        self.closed = False  # close(): executables dropped, params and cache deleted
        # Calls that ran a bucket's executable for the first time: on a CPU such a call takes ~15 ms
        # more than the next ones (measured), so timings of those steps are not representative.
        self.first_runs = 0
        self._ran: set[tuple] = set()
        # Token history for repetition/presence/frequency penalties, padded to one fixed length so
        # penalties never recompile (B x history_len int32s per step: small beside the weights).
        self.history_len = buckets.page_counts[-1] * cache.page_size
        # Structured output: per L, the [R * L, ceil(V / 32)] host buffer the grammar masks are written
        # into, and the llguidance executor that fills it (made on the first constrained step).
        self._masks: dict[int, np.ndarray] = {}
        self._mask_executor: Any = None
        self.mask_seconds = 0.0  # host time spent computing grammar masks, all steps together
        self.masked_rows = 0  # constrained rows masked, all steps together
        self.platform = jax.default_backend()
        self.compiler_options = step_compiler_options(self.platform)
        # Multi-host, process 0 only: hands each step's packed inputs and each page copy to the other
        # processes before running it (jaxserve.runner.multihost.Leader); None in a single process.
        self.broadcaster: Any = None
        # A mesh spanning processes: the samples are made replicated in the step, since a process can
        # only read the shards on its own devices.
        self.out_sharding = None
        if shardings is not None and shardings.mesh.is_multi_process:
            self.out_sharding = jax.sharding.NamedSharding(shardings.mesh, jax.sharding.PartitionSpec())
        # The last step's samples, i32[R, max_rows], kept on the device: each step takes them in and
        # gives its own back, so a step's placeholders name tokens of the step before it
        # (jaxserve.model.placeholders). Replicated on a mesh: small, and every process can read it.
        self.carry_sharding = None if shardings is None else jax.sharding.NamedSharding(
            shardings.mesh, jax.sharding.PartitionSpec())
        self.carried = jax.device_put(np.zeros((self.num_replicas, buckets.max_rows), np.int32), self.carry_sharding)
        self.speculation: spec_steps.Speculation | None = None  # enable_speculation
        CompileCounter.install()

    def enable_speculation(self, method: str, num_tokens: int, draft: Any = None) -> spec_steps.Speculation:
        """Hold speculative decoding's executables too (and, for the draft method, the loaded `draft`
        model's params and a cache of its own over the same page ids)."""
        self.speculation = spec_steps.Speculation.load(method, num_tokens, draft, self.cache.num_pages,
                                                       self.cache.page_size, self.num_replicas)
        return self.speculation

    # ---- compilation ---------------------------------------------------------------------------
    def step_shapes(self) -> list[tuple]:
        """Every (tokens, pages) ragged step the engine may run (and their multi-step variants); see
        `buckets.step_shapes`."""
        return bucket_shapes.step_shapes(self.buckets, self.num_scheduler_steps)

    def is_speculative(self, shape: tuple) -> bool:
        """Whether bucket `shape` is a speculative step (every plain bucket of a speculative engine)."""
        return self.speculation is not None and len(shape) == 2

    def num_logits(self, num_tokens: int) -> int:
        """Logits a step of `num_tokens` tokens returns: one per row that samples, at most one per
        token and one per row."""
        return min(num_tokens, self.buckets.max_rows)

    def step_inputs(self, shape: tuple) -> tuple:
        """ShapeDtypeStructs of the host inputs of bucket `shape`, as `run_packed` takes them:
        (RaggedBatch, SamplingTensors, TokenMask), plus (sample index, targets) for a scoring variant or each
        row's step count for a multi-step one. (They travel packed: jaxserve.model.transfer gives the one
        packed array its sharding.) A speculative step's: see `spec_steps.step_inputs`."""
        N, P = shape[:2]
        R, S = self.num_replicas, self.buckets.max_rows
        L = self.num_logits(N)
        if self.is_speculative(shape):
            return spec_steps.step_inputs(self.speculation, N, P, L, S, R, self.history_len)
        score = shape[2:] == (SCORE,)

        def i32(*dims):
            return jax.ShapeDtypeStruct((R,) + dims, jnp.int32)

        batch = RaggedBatch(tokens=i32(N), positions=i32(N), slots=i32(N), token_row=i32(N),
                            query_start=i32(S + 1), context_lens=i32(S), page_table=i32(S, P),
                            logit_index=i32(N if score else L))
        inputs = (batch, SamplingTensors.spec((R, L), self.history_len), TokenMask.spec((R, L), self.cfg.vocab_size))
        if score:  # which of the N logits sample, and each token's next token, scored
            return inputs + (i32(L), i32(N))
        if shape[2:] == (MULTI_STEP,):  # how many of the decode steps each row takes part in
            return inputs + (i32(S),)
        return inputs

    def score_shapes(self) -> list[tuple]:
        """The prompt-scoring variants (compiled when prompt logprobs are enabled)."""
        return bucket_shapes.score_shapes(self.buckets)

    def _lower(self, shape: tuple):
        packed, fields = split_sparse(self.step_inputs(shape))
        layout = self._layouts[shape] = Layout.of(packed)
        sparse = tuple(jax.ShapeDtypeStruct((f.shape[0], math.prod(f.shape[1:])), f.dtype, sharding=self.buffer_sharding)
                       for f in fields)
        if self.is_speculative(shape):
            return spec_steps.lower(self, layout, sparse)
        cache_sharding = None if self.shardings is None else cache_shardings(
            self.shardings, "int8" if self.cache.quantized else "auto")
        static = dict(cfg=self.cfg, options=self.options, cache_sharding=cache_sharding,
                      out_sharding=self.out_sharding, carry_sharding=self.carry_sharding)
        if shape[2:] == (MULTI_STEP,):
            step = _multi_decode_step_jit
            static.update(num_steps=self.num_scheduler_steps, page_size=self.cache.page_size)
        elif shape[2:] == (SCORE,):
            step = _score_step_jit
        else:
            step = _generate_step_jit
        carried = jax.ShapeDtypeStruct(self.carried.shape, jnp.int32, sharding=self.carry_sharding)
        return step.trace(self.params, self.cache, carried, sparse, layout.spec(self.buffer_sharding), layout=layout,
                          **static).lower()

    def compile(self, shape: tuple):
        self.check_open()
        executable = self._executables.get(shape)
        if executable is None:
            executable = self._executables[shape] = self._lower(shape).compile(self.compiler_options)
        return executable

    def warm_up(self, shapes: list[tuple] | None = None, progress: bool = True) -> list[tuple]:
        """Compile every bucket ahead of time; returns (shape, seconds) per bucket.

        Tracing holds the GIL, so buckets are lowered one by one, each compiled meanwhile on a pool.
        XLA:CPU already spreads one compile over every core (its codegen is split), so on a CPU the
        pool has one thread: two compiles at once on 2 cores started ~6 s slower (docs/BENCHMARKS.md,
        "One compile at a time on a CPU"). Elsewhere it has one thread per core.
        """
        from concurrent.futures import ThreadPoolExecutor

        from tqdm import tqdm

        shapes = [s for s in (shapes if shapes is not None else self.step_shapes()) if s not in self._executables]
        logger.info("compiling %d step buckets: %s", len(shapes), shapes)

        def compile_one(shape, lowered):
            start = time.perf_counter()
            executable = lowered.compile(self.compiler_options)
            return shape, executable, time.perf_counter() - start

        workers = 1 if self.platform == "cpu" else (os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers) as pool, \
                tqdm(total=len(shapes), desc="compiling step buckets", disable=not progress, unit="bucket") as bar:
            futures = []
            for shape in shapes:
                future = pool.submit(compile_one, shape, self._lower(shape))
                future.add_done_callback(lambda _: bar.update(1))
                futures.append(future)
            results = [f.result() for f in futures]
        timings = []
        for shape, executable, seconds in results:
            self._executables[shape] = executable
            timings.append((shape, seconds))
        for shape, seconds in timings:
            logger.info("bucket %s compiled in %.2fs", shape, seconds)
        self.run_each_once(shapes)
        return timings

    def run_each_once(self, shapes: Sequence[tuple]) -> None:
        """Call each bucket's executable once on all-zero inputs (every token's K/V to slot 0, on the
        padding page, which no sequence owns), so that the ~15 ms a first call costs on a CPU is paid
        at start-up, not by the first request needing that bucket. Same order in every process of a
        multi-host mesh."""
        for shape in shapes:
            if shape in self._ran:
                continue
            zeros = self._layouts[shape].zeros(self.buffer_sharding)
            self._call(shape, self._executables[shape], self._idle_sparse(shape), zeros)
            self._ran.add(shape)
        jax.block_until_ready(self.cache)

    def copy_pages(self, replica: int, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy pages src[i] -> dst[i] of one replica (forked sequences), in one compiled width; the
        draft's cache too."""
        self.check_open()
        if self.broadcaster is not None:
            self.broadcaster.copy_pages(replica, src, dst)
        width = self.buckets.batch_sizes[-1]
        self.cache = copy_pages_padded(self.cache, replica, src, dst, width)
        spec = self.speculation
        if spec is not None and spec.draft_cache is not None:
            spec.draft_cache = copy_pages_padded(spec.draft_cache, replica, src, dst, width)

    def probe_rows(self, rows: Sequence[RowWork]):
        """`probe` of the step these rows pack into (rows on the padding page, which no sequence
        owns): what speculation times its steps with."""
        packed = self._pack(rows, score=False)
        return self.probe(packed.shape, packed.inputs)

    def probe(self, shape: tuple, inputs: tuple):
        """A callable that runs bucket `shape`'s executable on these host inputs (rows on the padding
        page, which no sequence owns) and returns its outputs, for timing: the inputs are copied to the
        device once, here. Multi-host: every call is handed to the other processes first, as a step."""
        executable = self.compile(shape)
        packed, fields = split_sparse(inputs)
        sparse, buffer = self._put_sparse(shape, fields), self.put_inputs(shape, packed)
        if shape not in self._ran:
            self._ran.add(shape)
            self.first_runs += 1

        def run():
            if self.broadcaster is not None:
                self.broadcaster.step(shape, inputs)
            return self._call(shape, executable, sparse, buffer)
        return run

    # ---- execution -----------------------------------------------------------------------------
    def execute(self, rows: Sequence[RowWork]) -> SampleOutput | tuple[SampleOutput, PromptScores]:
        """Run one ragged step for `rows` (any mix of replicas, prompt chunks and decodes); returns
        each row's sample, in row order (tokens i32[n], logprobs f32[n], top_ids i32[n, MAX_LOGPROBS],
        top_logprobs f32[n, MAX_LOGPROBS]); a row that does not sample gets meaningless values.

        If any row has `targets`, the step also scores every token (the scoring variant) and returns
        (samples, PromptScores of shape [n, tokens of the longest row, ...])."""
        return self.launch(rows).result()

    def launch(self, rows: Sequence[RowWork], before_masks: Callable[[], None] | None = None,
               logprobs: bool = True) -> PendingSamples:
        """`execute` without the wait: `pack`, then `dispatch`."""
        return self.dispatch(self.pack(rows, before_masks), logprobs)

    def pack(self, rows: Sequence[RowWork], before_masks: Callable[[], None] | None = None) -> PackedRows:
        """Lay a step's rows out on the host (nothing is sent yet). A row's tokens may hold
        placeholders of the previous step's samples (jaxserve.model.placeholders). `before_masks` runs once
        the inputs are packed, before the grammar rows' masks are filled (async scheduling: it hands
        those grammars the previous step's tokens)."""
        return self._pack(rows, score=any(r.targets is not None for r in rows), before_masks=before_masks)

    def dispatch(self, packed: PackedRows, logprobs: bool = True) -> PendingSamples:
        """Send a packed step to the device and run it (not waiting for it); its samples' copy to
        the host starts at once. `logprobs=False`: the samples' logprobs are not fetched (no row
        asked for them)."""
        start_copy = self.platform != "cpu"
        if packed.score_inputs is None:
            return PendingSamples(self.run_step(packed.shape, packed.inputs, packed.buffer), packed, logprobs,
                                  start_copy)
        sample_index, targets = packed.score_inputs
        out = self.run_step(packed.shape + (SCORE,), (packed.batch, packed.sampling, packed.mask, sample_index, targets))
        return PendingSamples(out, packed, logprobs, start_copy)

    def execute_multi(self, rows: Sequence[RowWork], steps: Sequence[int]) -> SampleOutput:
        """Run `num_scheduler_steps` decode steps for single-token `rows` in one call; row i takes part
        in its first steps[i] (its pages must hold start_pos + steps[i] tokens). Returns the samples
        with a leading step axis: tokens i32[num_scheduler_steps, n], and so on; a row's samples past
        its steps are meaningless."""
        if not 1 <= max(steps) <= self.num_scheduler_steps:
            raise ValueError(f"steps per row must be in [1, {self.num_scheduler_steps}], got {list(steps)}")
        if any(len(r.tokens) != 1 or not r.samples for r in rows):
            raise ValueError("multi-step runs decode rows only (one token each, sampling)")
        packed = self._pack(rows, score=False, extra_tokens=[n - 1 for n in steps])
        per_row = np.zeros((self.num_replicas, self.buckets.max_rows), np.int32)
        for (rep, t, _), n in zip(packed.token_at, steps):
            per_row[rep, t] = n  # a pure decode step: row k's token is token k
        out = jax.device_get(self.run_step(packed.shape + (MULTI_STEP,),
                                       (packed.batch, packed.sampling, packed.mask, per_row)))
        return jax.tree.map(lambda x: x.reshape(x.shape[:1] + (-1,) + x.shape[3:])[:, packed.logit_at], out)

    def _pack(self, rows: Sequence[RowWork], score: bool, extra_tokens: Sequence[int] | None = None,
              before_masks: Callable[[], None] | None = None) -> PackedRows:
        """Lay rows out in the smallest ragged bucket: NumPy arrays with leading R. `extra_tokens`:
        positions each row writes after its tokens within this call (multi-step), which its pages hold.
        A plain step is written into its bucket's StepWriter (only what changed since its last step);
        scoring and multi-step calls are packed from scratch; a speculative engine's steps but scoring
        ones by `spec_steps.pack`."""
        if self.speculation is not None and not score:
            return spec_steps.pack(self, rows)
        R, ps = self.num_replicas, self.cache.page_size
        extra = extra_tokens or [0] * len(rows)
        # Each row's pages up to its last position this call: pages reserved beyond it are not read.
        need = [min(len(r.page_ids), -(-(r.start_pos + len(r.tokens) + e) // ps)) for r, e in zip(rows, extra)]
        if R == 1:
            n_tokens = sum(len(r.tokens) for r in rows)
        else:
            n_tokens = max(sum(len(r.tokens) for r in rows if r.replica == rep) for rep in range(R))
        shape = pick_step_shape(self.buckets, n_tokens, max(need))  # a scored step's too: the same buckets
        if not score and extra_tokens is None and shape in self._layouts:
            return self._pack_written(rows, shape, before_masks)
        return self._pack_anew(rows, shape, score, [r.page_ids[:n] for r, n in zip(rows, need)], before_masks)

    def _pack_written(self, rows: Sequence[RowWork], shape: tuple,
                      before_masks: Callable[[], None] | None) -> PackedRows:
        """`_pack` of a plain step through its bucket's StepWriter (made on the bucket's first step)."""
        writer = self._writers.get(shape)
        if writer is None:
            L = self.num_logits(shape[0])
            writer = self._writers[shape] = StepWriter(self._layouts[shape], page_size=self.cache.page_size,
                                                       idle_sparse=dict(zip(SPARSE_FIELDS, self._idle_host_sparse(L))))
        logit_at, token_at, grammars = writer.write(rows)
        R, L = self.num_replicas, writer.num_logits
        if any(r.sampling is not None and r.samples and (r.sampling.uses_penalties or r.sampling.logit_bias)
               for r in rows):  # the sparse inputs, built for the steps that need them
            flat: list[RowSampling | None] = [None] * (R * L)
            steps = [0] * (R * L)
            for row, at in zip(rows, logit_at.tolist()):
                if at >= 0 and row.sampling is not None:
                    flat[at] = row.sampling
                    steps[at] = row.sampling.step if row.step is None else row.step
            full = SamplingTensors.pack(flat, (R, L), self.history_len, steps=steps)
            sampling = writer.sampling_views.replace(**{name: getattr(full, name) for name in SPARSE_FIELDS})
        else:
            sampling = writer.idle_sampling
        if grammars:
            if before_masks is not None:
                before_masks()
            writer.write_masks(self._token_mask(R, L, grammars).bitmask)
        return PackedRows(shape, writer.batch, sampling, writer.mask(), logit_at, token_at, buffer=writer.buffer)

    def _pack_anew(self, rows: Sequence[RowWork], shape: tuple, score: bool, pages: list,
                   before_masks: Callable[[], None] | None) -> PackedRows:
        """`_pack` from scratch: pack_ragged per replica, SamplingTensors.pack, the TokenMask."""
        R, S, ps = self.num_replicas, self.buckets.max_rows, self.cache.page_size
        per_replica = [[i for i, r in enumerate(rows) if r.replica == rep] for rep in range(R)]
        N, P = shape
        L = self.num_logits(N)
        fields = {f.name: [] for f in dataclasses.fields(RaggedBatch)}
        flat_sampling: list[RowSampling | None] = [None] * (R * L)
        flat_steps = [0] * (R * L)
        logit_at = np.full(len(rows), -1, np.int64)
        token_at: list[tuple[int, int, int]] = [(0, 0, 1)] * len(rows)
        sample_index = np.zeros((R, L), np.int32)
        targets = np.zeros((R, N), np.int32)
        for rep, indices in enumerate(per_replica):
            arrays = pack_ragged([RaggedRow(rows[i].tokens, rows[i].start_pos, pages[i], int(rows[i].samples))
                                  for i in indices], page_size=ps, num_tokens=N, num_rows=S, max_pages=P, num_logits=L)
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
                    targets[rep, first: first + len(row.targets)] = row.targets
            if score:  # logits at every token; the sampler takes the rows' own
                sample_index[rep] = arrays.logit_index
                arrays = dataclasses.replace(arrays, logit_index=np.arange(N, dtype=np.int32))
            for name in fields:
                fields[name].append(getattr(arrays, name))
        batch = RaggedBatch(**{name: np.stack(v) for name, v in fields.items()})
        st = SamplingTensors.pack(flat_sampling, (R, L), self.history_len, steps=flat_steps)
        grammars = [(rows[i].grammar, int(logit_at[i])) for i in range(len(rows))
                    if rows[i].grammar is not None and logit_at[i] >= 0]
        if grammars and before_masks is not None:
            before_masks()
        return PackedRows(shape, batch, st, self._token_mask(R, L, grammars), logit_at, token_at,
                          (sample_index, targets) if score else None)

    def _token_mask(self, R: int, L: int, grammars: list[tuple[Any, int]]) -> TokenMask:
        """The step's TokenMask [R, L]: each constrained row's next-token mask, filled on the host by
        llguidance (its threads, GIL released). One buffer per L is kept and reused: the rows of free
        rows are never read on the device (their flag is off), so a step without a constrained row
        costs no mask work here, only the copy of the buffer into the step's inputs."""
        bitmask = self._masks.get(L)
        if bitmask is None:
            bitmask = self._masks[L] = np.full((R * L, -(-self.cfg.vocab_size // 32)), -1, np.int32)
        constrained = np.zeros(R * L, bool)
        if grammars:
            from jaxserve.structured import fill_bitmasks

            if self._mask_executor is None:
                import llguidance

                self._mask_executor = llguidance.LLExecutor()
            start = time.perf_counter()
            fill_bitmasks(grammars, bitmask, self._mask_executor)
            self.mask_seconds += time.perf_counter() - start
            self.masked_rows += len(grammars)
            constrained[[at for _, at in grammars]] = True
        return TokenMask(bitmask.reshape(R, L, -1), constrained.reshape(R, L))

    def run_step(self, shape: tuple, inputs: tuple, buffer: np.ndarray | None = None) -> Any:
        """`run_packed`, handed first to the other processes of a multi-host job (which make the same
        call, packing the inputs themselves): how every step runs, the speculative ones too
        (`jaxserve.spec_decode` calls it)."""
        if self.broadcaster is None:
            return self.run_packed(shape, inputs, buffer)
        self.broadcaster.step(shape, inputs)  # multi-host: the other processes run the same call
        try:
            return self.run_packed(shape, inputs, buffer)
        except Exception as err:  # noqa: BLE001 - the processes are out of step: fatal (it exits)
            self.broadcaster.step_failed(err)
            raise

    def run_packed(self, shape: tuple, inputs: tuple, buffer: np.ndarray | None = None) -> Any:
        """Dispatch the compiled step of bucket `shape` on packed host inputs ((RaggedBatch,
        SamplingTensors, ...) of NumPy arrays, leading axis R); returns the samples as device arrays,
        [R, L, ...] (not waited for). A speculative step's inputs and outputs: `spec_steps`.
        `buffer`: the inputs but the sparse ones already packed (a StepWriter's), copied as they are.
        Multi-host followers call this with the inputs process 0 packed."""
        self.check_open()
        if shape not in self._executables:
            self.unplanned_compiles += 1
            logger.warning("compiling unplanned step shape %s", shape)
        executable = self.compile(shape)
        if shape not in self._ran:
            self._ran.add(shape)
            self.first_runs += 1
        # Explicit transfers only (the step loop runs under jax.transfer_guard("disallow") in tests):
        # one host->device copy of the packed inputs here (and one of the sparse sampling inputs
        # when a row uses penalties or logit_bias); the samples' copy back is the caller's.
        if self.is_speculative(shape):
            packed, fields = split_sparse(inputs)
            self.last_sparse = self._put_sparse(shape, fields)
            return spec_steps.call(self, executable, self.last_sparse, self.put_inputs(shape, packed))
        sampling = inputs[1]
        self.last_sparse = self._put_sparse(shape, tuple(getattr(sampling, name) for name in SPARSE_FIELDS))
        staged = None
        if buffer is None:
            buffer = self._layouts[shape].pack(split_sparse(inputs)[0])
        else:  # a copy: the writer rewrites its buffer for the next step, and a CPU device may alias it
            staged, buffer = self._stage(shape, buffer)
        out, self.cache, self.carried = self._call_step(executable, buffer)
        if staged is not None:
            staged[1] = out.tokens  # ready once the step is done: then nothing reads that copy
        return out

    _MAX_STAGED = 4

    def _stage(self, shape: tuple, buffer: np.ndarray) -> tuple[list | None, np.ndarray]:
        """The copy of a writer's buffer that this step's call reads: a kept one whose last step is
        done (its output ready), rewritten in place, else a new one (kept while fewer than
        _MAX_STAGED are). A fresh NumPy array every step cost ~25 us of host time beside a running
        step here (its allocation; freeing the last one), rewriting a kept one ~0.5 us."""
        kept = self._staged.setdefault(shape, [])
        for entry in kept:
            if entry[1] is None or entry[1].is_ready():
                np.copyto(entry[0], buffer)
                entry[1] = None
                return entry, entry[0]
        copy = buffer.copy()
        if len(kept) >= self._MAX_STAGED:
            return None, copy
        kept.append([copy, None])
        return kept[-1], copy

    def _call(self, shape: tuple, executable: Any, sparse: tuple, buffer: jax.Array) -> Any:
        """Call bucket `shape`'s executable on device inputs (warm-up, probes), replacing the donated
        caches and the carried samples; returns its outputs (on the device)."""
        if self.is_speculative(shape):
            return spec_steps.call(self, executable, sparse, buffer)
        out, self.cache, self.carried = executable(self.params, self.cache, self.carried, sparse, buffer)
        return out

    def _call_step(self, executable: Any, buffer: np.ndarray) -> tuple:
        """Call a plain step's executable on its packed host buffer. In one process the NumPy buffer is
        the call's operand, and the executable's own argument handling copies it to the device: the
        same one transfer as `put_buffer`, without jax.device_put's Python path (~20 us on an idle
        CPU, 150-350 us of the host's time beside a running step on 2 shared cores: `docs/BENCHMARKS.md`). Declared
        where it happens: every other operand is already on the device. On a mesh spanning processes
        each process puts its own shards (`put_buffer`)."""
        if self.out_sharding is not None:
            return executable(self.params, self.cache, self.carried, self.last_sparse, self.put_buffer(buffer))
        with jax.transfer_guard_host_to_device("allow"):  # the packed inputs: this step's one copy in
            return executable(self.params, self.cache, self.carried, self.last_sparse, buffer)

    def put_inputs(self, shape: tuple, inputs: tuple) -> jax.Array:
        """Bucket `shape`'s host inputs but the sparse ones (`split_sparse`) packed into one array and
        copied to the device (sharded over the replicas on a mesh) in one transfer; the bucket must
        have been compiled."""
        return self.put_buffer(self._layouts[shape].pack(inputs))

    def put_buffer(self, host: np.ndarray) -> jax.Array:
        """A packed int32 [R, width] host buffer copied to the device in one explicit transfer."""
        return jax.device_put(host, self.buffer_sharding)

    def _put_sparse(self, shape: tuple, fields: tuple[np.ndarray, ...]) -> tuple[jax.Array, ...]:
        """The SPARSE_FIELDS on the device as [R, L * width]: copied (one transfer) when some row has
        a penalty history or logit_bias entries, else the idle arrays already there."""
        history, bias_ids = fields[0], fields[1]
        idle = self._idle_host.get(history.shape[1])
        if (idle is not None and history is idle[0] and bias_ids is idle[1]) or not (
                (history[..., 0] >= 0).any() or (bias_ids[..., 0] >= 0).any()):
            return self._idle_sparse(shape)
        R = history.shape[0]
        return jax.device_put(tuple(np.ascontiguousarray(f).reshape(R, -1) for f in fields), self.buffer_sharding)

    def _idle_sparse(self, shape: tuple) -> tuple[jax.Array, ...]:
        """Bucket `shape`'s SPARSE_FIELDS as no row uses them (empty histories, no bias), kept on the
        device per number of logits L, so steps without penalties or logit_bias copy none of them."""
        L = self.num_logits(shape[0])
        idle = self._idle.get(L)
        if idle is None:
            st = SamplingTensors.pack([], (self.num_replicas, L), self.history_len)
            fields = tuple(getattr(st, name).reshape(self.num_replicas, -1) for name in SPARSE_FIELDS)
            idle = self._idle[L] = jax.device_put(fields, self.buffer_sharding)
        return idle

    def _idle_host_sparse(self, L: int) -> tuple[np.ndarray, ...]:
        """The SPARSE_FIELDS of a step of L logits where no row uses them, on the host (kept per L)."""
        idle = self._idle_host.get(L)
        if idle is None:
            st = SamplingTensors.pack([], (self.num_replicas, L), self.history_len)
            idle = self._idle_host[L] = tuple(getattr(st, name) for name in SPARSE_FIELDS)
        return idle

    @property
    def buffer_sharding(self) -> Any:
        """The packed inputs' sharding: over the replicas (the `data` axis) on a mesh."""
        return None if self.shardings is None else self.shardings.batch2

    # ---- release -------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop every compiled executable and delete the params' and the KV caches' device buffers (the
        draft's too); afterwards every call raises EngineClosedError. The executables' code is unmapped once JAX's
        in-memory compilation cache lets go of them too (`compile.release_compiled_code`, which
        `LLMEngine.close` calls after this)."""
        if self.closed:
            return
        self.closed = True
        self._executables.clear()
        self._layouts.clear()
        self._idle.clear()
        self._idle_host.clear()
        self._writers.clear()
        self._staged.clear()
        self.last_sparse = None
        self._ran.clear()
        delete_buffers((self.params, self.cache, self.carried))
        self.params = self.cache = self.carried = None
        if self.speculation is not None:
            spec = self.speculation
            delete_buffers((spec.draft_params, spec.draft_cache))
            spec.draft_params = spec.draft_cache = None

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this engine is closed (its executables, weights and KV cache are released); "
                                    "build a new one")


def delete_buffers(tree: Any) -> None:
    """Free the device buffers of every jax.Array in `tree` now (not when the last reference goes):
    a later use raises jax's "Array has been deleted" instead of reading freed memory."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()
