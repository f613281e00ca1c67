"""The model runner: lays a step's rows out, runs its executable, hands back its samples.

It is the only place where host state becomes device arrays, and the one owner of executables. A
step is a flat axis of `N` tokens per replica (`jaxserve.model.ragged`): decodes, prompt chunks and their
mix in one call. Each (tokens, pages) bucket of `buckets.step_shapes` is compiled once ahead of time;
the cache is donated into every call and replaced by the result. With speculative decoding every
bucket is compiled from the speculative step instead (`speculative.py`: verifications among the rows,
the draft model inside), and the runner also holds the draft's params and cache; `jaxserve.spec_decode`
decides each row's drafts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine import buckets as bucket_shapes
from jaxserve.engine.buckets import MULTI_STEP, SCORE, BucketTable, pick_step_shape
from jaxserve.runner.speculative import Speculation
from jaxserve.runner.step_io import StepInputs, PendingSamples, StepSamples, split_sparse
from jaxserve.engine.row_work import RowWork
from jaxserve.runner.compilation import CompileCounter, compile_buckets, release_compiled_code, step_compiler_options
from jaxserve.runner.grammar_masks import GrammarMasks
from jaxserve.runner.input_batch import InputBatch
from jaxserve.errors import EngineClosedError
from jaxserve.model.kv_cache import KVCache, RaggedBatch, cache_shardings, copy_pages_padded
from jaxserve.runner.step_functions import generate_step, multi_decode_step, score_step
from jaxserve.model.weights import Params
from jaxserve.model.ragged import RaggedArrays, RaggedRow, pack_ragged, row_lora_slots
from jaxserve.model.sampler import RowSampling, SamplingTensors
from jaxserve.model.step_options import StepOptions
from jaxserve.structured.apply import TokenMask
from jaxserve.model.transfer import SPARSE_FIELDS, Layout

logger = logging.getLogger(__name__)


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
        self._input_batches: dict[tuple, InputBatch] = {}  # per plain bucket: its inputs, kept and rewritten
        # Per plain bucket: the copies of its writer's buffer handed to calls, each with an output of
        # the step that read it (None: not yet called), reused once that output is ready (`_stage`).
        self._staged: dict[tuple, list[list[Any]]] = {}
        self.last_sparse: tuple | None = None  # the last step's sparse sampling inputs (benchmarks reuse them)
        self.unplanned_compiles = 0  # shapes that were not in the warmed table
        self.compiles_at_warm_up: int | None = None  # CompileCounter.requests once warmed up
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
        self.grammar_masks = GrammarMasks(self.num_replicas, cfg.vocab_size)
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
        self.speculation: Speculation | None = None  # enable_speculation
        self.lora: Any = None  # enable_lora: runner.lora.LoRASlots
        CompileCounter.install()

    def enable_lora(self, slots: Any) -> None:
        """Serve LoRA adapters: every layer's params get `slots`' resident stacks (zeros), and each step
        a row slot input (`RaggedBatch.row_lora`). Before any step is compiled: the steps take the
        stacks as part of the params. The slot write is compiled here (an empty adapter into slot 0),
        so loading adapters later compiles nothing."""
        if self._executables:
            raise RuntimeError("enable_lora must come before the steps are compiled")
        self.lora = slots
        self.params = slots.write(slots.attach(self.params), 0, NO_ADAPTER)

    def write_lora(self, slot: int, adapter: Any) -> None:
        """Put `adapter` (a `lora.peft_adapter.PeftAdapter`) into device slot `slot`: queued behind the
        steps already dispatched, so they still read the slot's old adapter."""
        self.check_open()
        self.params = self.lora.write(self.params, slot, adapter)

    def enable_speculation(self, method: str, num_tokens: int, draft: Any = None) -> Speculation:
        """Compile every ragged bucket as a speculative step (and hold, for the draft method, the
        loaded `draft` model's params and a cache of its own over the same page ids)."""
        self.speculation = Speculation.load(self, method, num_tokens, draft)
        return self.speculation

    def _steps(self, shape: tuple) -> Any:
        """Whose step bucket `shape` is: a speculative engine's ragged buckets are its Speculation's;
        every other bucket (and every bucket of a plain engine) is the runner's own. Both give
        `input_specs`, `lower` and `call`."""
        return self.speculation if self.speculation is not None and len(shape) == 2 else self

    # ---- compilation ---------------------------------------------------------------------------
    def step_shapes(self) -> list[tuple]:
        """Every (tokens, pages) ragged step the engine may run (and their multi-step variants); see
        `buckets.step_shapes`."""
        return bucket_shapes.step_shapes(self.buckets, self.num_scheduler_steps)

    def num_logits(self, num_tokens: int) -> int:
        """Logits a step of `num_tokens` tokens returns: one per row that samples, at most one per
        token and one per row."""
        return min(num_tokens, self.buckets.max_rows)

    def step_inputs(self, shape: tuple) -> tuple:
        """ShapeDtypeStructs of the host inputs of bucket `shape`, as `run_step` takes them (they
        travel packed: jaxserve.model.transfer gives the one packed array its sharding)."""
        return self._steps(shape).input_specs(shape)

    def input_specs(self, shape: tuple) -> tuple:
        """The runner's own steps' inputs: (RaggedBatch, SamplingTensors, TokenMask), plus (sample
        index, targets) for a scoring variant or each row's step count for a multi-step one."""
        N, P = shape[:2]
        R, S = self.num_replicas, self.buckets.max_rows
        L = self.num_logits(N)
        score = shape[2:] == (SCORE,)

        def i32(*dims):
            return jax.ShapeDtypeStruct((R,) + dims, jnp.int32)

        batch = RaggedBatch(tokens=i32(N), positions=i32(N), slots=i32(N), token_row=i32(N),
                            query_start=i32(S + 1), context_lens=i32(S), page_table=i32(S, P),
                            logit_index=i32(N if score else L), row_lora=i32(S) if self.lora is not None else None)
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
        return self._steps(shape).lower(shape, layout, sparse)

    def lower(self, shape: tuple, layout: Layout, sparse: tuple):
        """Lower the runner's own step of bucket `shape` (plain, scoring or multi-step)."""
        cache_sharding = None if self.shardings is None else cache_shardings(
            self.shardings, "int8" if self.cache.quantized else "auto")
        static = dict(cfg=self.cfg, options=self.options, cache_sharding=cache_sharding,
                      out_sharding=self.out_sharding, carry_sharding=self.carry_sharding)
        if shape[2:] == (MULTI_STEP,):
            step = multi_decode_step
            static.update(num_steps=self.num_scheduler_steps, page_size=self.cache.page_size)
        elif shape[2:] == (SCORE,):
            step = score_step
        else:
            step = generate_step
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
        """Compile every bucket ahead of time (`compilation.compile_buckets`) and run each once;
        returns (shape, seconds) per bucket compiled."""
        shapes = [s for s in (shapes if shapes is not None else self.step_shapes()) if s not in self._executables]
        logger.info("compiling %d step buckets: %s", len(shapes), shapes)
        timings = []
        for shape, executable, seconds in compile_buckets(shapes, self._lower, self.compiler_options,
                                                          self.platform, progress):
            self._executables[shape] = executable
            timings.append((shape, seconds))
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

    def warm_up_page_copies(self) -> None:
        """Compile the page copy of forked (n > 1) sequences, one per replica."""
        for replica in range(self.num_replicas):
            self.copy_pages(replica, np.zeros(0, np.int32), np.zeros(0, np.int32))

    def num_executables(self) -> int:
        """Compiled executables this runner holds: its step buckets and their variants, the speculative
        steps, and the page copy of forked sequences (one per replica and KV cache, once compiled)."""
        if self.closed:
            return 0
        draft = self.speculation is not None and self.speculation.draft_cache is not None
        copies = self.num_replicas * (2 if draft else 1)
        lora_write = 1 if self.lora is not None else 0
        return len(self._executables) + lora_write + (copies if self.compiles_at_warm_up is not None else 0)

    def stats(self) -> dict:
        return dict(
            compiles_after_warmup=(CompileCounter.requests - self.compiles_at_warm_up)
            if self.compiles_at_warm_up is not None else None,
            executables=self.num_executables(),
            # structured output: host time computing grammar masks, and the constrained rows masked
            grammar_mask_seconds_total=self.grammar_masks.seconds,
            grammar_masked_rows_total=self.grammar_masks.rows,
        )

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
        packed = self.prepare_inputs(rows)
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
    def prepare_inputs(self, rows: Sequence[RowWork], before_masks: Callable[[], None] | None = None) -> StepInputs:
        """Lay a step's rows out on the host (nothing is sent yet), in the variant they need: the
        scoring step when a row has prompt-logprob `targets`; on a speculative engine its speculative
        step (`speculative.pack`); a multi-step call when a row takes several decode steps; else the
        plain step, written into its bucket's persistent InputBatch (only what changed since the
        bucket's last step). A row's tokens may hold placeholders of the previous step's samples
        (jaxserve.model.placeholders). `before_masks` runs once the inputs are packed, before the
        grammar rows' masks are filled (async scheduling: it hands those grammars the previous
        step's tokens)."""
        score = any(r.targets is not None for r in rows)
        if self.speculation is not None and not score:
            return self.speculation.pack(rows)
        steps = [r.num_steps for r in rows]
        multi = max(steps) > 1
        if multi and (max(steps) > self.num_scheduler_steps
                      or any(len(r.tokens) != 1 or not r.samples for r in rows)):
            raise ValueError(f"a multi-step call takes decode rows only (one token each, sampling), each of "
                             f"1 to {self.num_scheduler_steps} steps; got {steps}")
        R, ps = self.num_replicas, self.cache.page_size
        # Each row's pages up to its last position this call: pages reserved beyond it are not read.
        need = [min(len(r.page_ids), -(-(r.start_pos + len(r.tokens) + n - 1) // ps)) for r, n in zip(rows, steps)]
        if R == 1:
            n_tokens = sum(len(r.tokens) for r in rows)
        else:
            n_tokens = max(sum(len(r.tokens) for r in rows if r.replica == rep) for rep in range(R))
        shape = pick_step_shape(self.buckets, n_tokens, max(need))  # a scored step's too: the same buckets
        if not score and not multi and shape in self._layouts:
            return self._pack_written(rows, shape, before_masks)
        packed = self._pack_anew(rows, shape, score, [r.page_ids[:n] for r, n in zip(rows, need)], before_masks)
        if multi:
            packed.steps_per_row = np.zeros((R, self.buckets.max_rows), np.int32)
            for (rep, t, _), n in zip(packed.token_at, steps):
                packed.steps_per_row[rep, t] = n  # a pure decode step: row k's token is token k
            packed.num_steps = steps
        return packed

    def execute(self, packed: StepInputs, logprobs: bool = True) -> PendingSamples:
        """Run a prepared step on the device (not waiting for it); its samples' copy to the host
        starts at once. `logprobs=False`: the samples' logprobs are not fetched (no row asked)."""
        variant = (SCORE,) if packed.score_inputs is not None else (MULTI_STEP,) if packed.num_steps else ()
        out = self.run_step(packed.shape + variant, packed.inputs, packed.buffer)
        return PendingSamples(out, packed, logprobs, start_copy=self.platform != "cpu")

    def execute_rows(self, rows: Sequence[RowWork]) -> StepSamples:
        """`prepare_inputs`, `execute`, and wait for the samples: one step run to completion (tests,
        benchmarks, speculation's calibration)."""
        return self.execute(self.prepare_inputs(rows)).result()

    def _pack_written(self, rows: Sequence[RowWork], shape: tuple,
                      before_masks: Callable[[], None] | None) -> StepInputs:
        """`_pack` of a plain step through its bucket's InputBatch (made on the bucket's first step)."""
        writer = self._input_batches.get(shape)
        if writer is None:
            L = self.num_logits(shape[0])
            writer = self._input_batches[shape] = InputBatch(self._layouts[shape], page_size=self.cache.page_size,
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
            writer.write_masks(self.grammar_masks.fill(L, grammars).bitmask)
        return StepInputs(shape, writer.batch, sampling, writer.mask(), logit_at, token_at, buffer=writer.buffer)

    def _pack_anew(self, rows: Sequence[RowWork], shape: tuple, score: bool, pages: list,
                   before_masks: Callable[[], None] | None) -> StepInputs:
        """`_pack` from scratch: pack_ragged per replica, SamplingTensors.pack, the TokenMask."""
        R, S, ps = self.num_replicas, self.buckets.max_rows, self.cache.page_size
        per_replica = [[i for i, r in enumerate(rows) if r.replica == rep] for rep in range(R)]
        N, P = shape
        L = self.num_logits(N)
        fields = {f.name: [] for f in dataclasses.fields(RaggedArrays)}
        row_lora = [row_lora_slots([rows[i].lora_slot for i in indices], S) for indices in per_replica]
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
        batch = RaggedBatch(**{name: np.stack(v) for name, v in fields.items()},
                            row_lora=np.stack(row_lora) if self.lora is not None else None)
        st = SamplingTensors.pack(flat_sampling, (R, L), self.history_len, steps=flat_steps)
        grammars = [(rows[i].grammar, int(logit_at[i])) for i in range(len(rows))
                    if rows[i].grammar is not None and logit_at[i] >= 0]
        if grammars and before_masks is not None:
            before_masks()
        return StepInputs(shape, batch, st, self.grammar_masks.fill(L, grammars), logit_at, token_at,
                          (sample_index, targets) if score else None)

    def run_step(self, shape: tuple, inputs: tuple, buffer: np.ndarray | None = None) -> Any:
        """Dispatch the compiled step of bucket `shape` on host inputs ((RaggedBatch, SamplingTensors,
        ...) of NumPy arrays, leading axis R); returns its outputs as device arrays, [R, L, ...] (not
        waited for). `buffer`: the inputs but the sparse ones already packed (an InputBatch's),
        copied as they are. On process 0 of a multi-host job the inputs go first to the other
        processes, which make the same call with them (`multihost.follower_loop`)."""
        if self.broadcaster is None:
            return self._dispatch(shape, inputs, buffer)
        self.broadcaster.step(shape, inputs)
        try:
            return self._dispatch(shape, inputs, buffer)
        except Exception as err:  # noqa: BLE001 - the processes are out of step: fatal (it exits)
            self.broadcaster.step_failed(err)
            raise

    def _dispatch(self, shape: tuple, inputs: tuple, buffer: np.ndarray | None) -> Any:
        self.check_open()
        if shape not in self._executables:
            self.unplanned_compiles += 1
            logger.warning("compiling unplanned step shape %s", shape)
        executable = self.compile(shape)
        if shape not in self._ran:
            self._ran.add(shape)
            self.first_runs += 1
        # Explicit transfers only (the step loop runs under jax.transfer_guard("disallow") in tests):
        # one host->device copy of the packed inputs (and one of the sparse sampling inputs when a
        # row uses penalties or logit_bias); the samples' copy back is the caller's.
        packed, fields = split_sparse(inputs)
        self.last_sparse = self._put_sparse(shape, fields)
        staged = None
        if buffer is None:
            buffer = self._layouts[shape].pack(packed)
        else:  # a copy: the input batch rewrites its buffer for the next step, and a CPU device may alias it
            staged, buffer = self._stage(shape, buffer)
        out = self._call(shape, executable, self.last_sparse, buffer)
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

    def _call(self, shape: tuple, executable: Any, sparse: tuple, buffer: Any) -> Any:
        """Call bucket `shape`'s executable, replacing the donated caches and the carried samples;
        returns its outputs (on the device). `buffer`: the packed inputs, on the device or a NumPy
        array. In one process a NumPy buffer is the call's operand, and the executable's own
        argument handling copies it to the device: the same one transfer as `put_buffer`, without
        jax.device_put's Python path (~20 us on an idle CPU, 150-350 us of the host's time beside a
        running step on 2 shared cores: `docs/BENCHMARKS.md`). Declared where it happens: every
        other operand is already on the device. On a mesh spanning processes each process puts its
        own shards (`put_buffer`)."""
        if isinstance(buffer, np.ndarray) and self.out_sharding is not None:
            buffer = self.put_buffer(buffer)
        with jax.transfer_guard_host_to_device("allow"):  # the packed inputs: this step's one copy in
            return self._steps(shape).call(executable, sparse, buffer)

    def call(self, executable: Any, sparse: tuple, buffer: Any) -> Any:
        """Call one of the runner's own steps' executables."""
        out, self.cache, self.carried = executable(self.params, self.cache, self.carried, sparse, buffer)
        return out

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
        draft's too); afterwards every call raises EngineClosedError. The executables' code is unmapped
        once JAX's in-memory compilation cache lets go of them too (`compilation.release_compiled_code`)."""
        if self.closed:
            return
        self.closed = True
        self._executables.clear()
        self._layouts.clear()
        self._idle.clear()
        self._idle_host.clear()
        self._input_batches.clear()
        self._staged.clear()
        self.last_sparse = None
        self._ran.clear()
        delete_buffers((self.params, self.cache, self.carried))
        self.params = self.cache = self.carried = None
        if self.speculation is not None:
            spec = self.speculation
            delete_buffers((spec.draft_params, spec.draft_cache))
            spec.draft_params = spec.draft_cache = None
        release_compiled_code()

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this engine is closed (its executables, weights and KV cache are released); "
                                    "build a new one")


# What `enable_lora` compiles the slot write with: an adapter of no modules (zeros everywhere).
NO_ADAPTER = types.SimpleNamespace(modules={})


def delete_buffers(tree: Any) -> None:
    """Free the device buffers of every jax.Array in `tree` now (not when the last reference goes):
    a later use raises jax's "Array has been deleted" instead of reading freed memory."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()
