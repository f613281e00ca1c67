"""The model runner: packs scheduled work into bucketed arrays, calls the compiled step, fetches tokens.

It is the only place where host state becomes device arrays. Each (batch, tokens, pages) bucket is
compiled once ahead of time; the cache is donated into every call and replaced by the result.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine import buckets as bucket_shapes
from jaxserve.engine.buckets import MULTI_STEP, BucketTable, pick_bucket
from jaxserve.engine.compile import CompileCounter, step_compiler_options
from jaxserve.errors import EngineClosedError
from jaxserve.kv_cache import PADDING_PAGE, KVCache, StepBatch, cache_shardings, copy_pages_padded
from jaxserve.model.weights import Params
from jaxserve.sampling import MAX_LOGPROBS, RowSampling, SampleOutput, SamplingTensors, sample
from jaxserve.steps import StepOptions, model_step
from jaxserve.transfer import Layout, from_buffer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RowWork:
    """One sequence's share of a step: compute `tokens` starting at `start_pos`, then sample one token."""

    tokens: Sequence[int]
    start_pos: int
    page_ids: Sequence[int]
    sampling: RowSampling | None = None  # None: greedy
    replica: int = 0
    # With prompt logprobs: the token after each of `tokens` (what its logits are scored against).
    targets: Sequence[int] | None = None


def _generate_step(params, cache, batch, sampling, cfg, options, cache_sharding=None, out_sharding=None):
    logits, cache = model_step(params, cache, batch, cfg, options)  # f32[R, B, V]
    if cache_sharding is not None:  # keep the donated cache's layout stable from step to step
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding)
    # Top logprobs are always computed: one top-k over the vocabulary is cheap beside the step, and a
    # second compiled variant per bucket would double start-up time.
    out = sample(logits, sampling, want_logprobs=MAX_LOGPROBS)
    if out_sharding is not None:  # multi-host: every process reads its own full copy of the samples
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out, cache


# The compiled steps take (params, cache, packed inputs): see jaxserve.transfer.
_generate_step_jit = jax.jit(from_buffer(_generate_step, 2), static_argnames=(
    "layout", "cfg", "options", "cache_sharding", "out_sharding"), donate_argnums=(1,))


def _multi_decode_step(params, cache, batch, sampling, steps, cfg, options, num_steps, cache_sharding=None,
                       out_sharding=None):
    """`num_steps` decode steps in one call (num_scheduler_steps): each feeds the token it sampled to
    the next, so the host is not needed in between. Row i takes part in its first steps[i] steps and is
    padding after (it writes nothing: its pages beyond those are not its own). Samples: [num_steps, ...]."""
    def one(carry, k):
        cache, batch, sampling = carry
        active = (k < steps).astype(jnp.int32)
        batch = batch.replace(num_new=active)
        out, cache = _generate_step(params, cache, batch, sampling, cfg, options, cache_sharding)
        batch = batch.replace(tokens=out.tokens[..., None].astype(jnp.int32), start_pos=batch.start_pos + active)
        return (cache, batch, sampling.advanced(out.tokens)), out

    (cache, _, _), out = jax.lax.scan(one, (cache, batch, sampling), jnp.arange(num_steps, dtype=jnp.int32))
    if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out, cache


_multi_decode_step_jit = jax.jit(from_buffer(_multi_decode_step, 2), static_argnames=(
    "layout", "cfg", "options", "num_steps", "cache_sharding", "out_sharding"), donate_argnums=(1,))


@flax.struct.dataclass
class PromptScores:
    """Per chunk token t: the logprob of the token after it (`targets[t]`) and the top-N alternatives."""

    target_logprobs: jax.Array  # f32[R, B, T]
    top_ids: jax.Array  # i32[R, B, T, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[R, B, T, MAX_LOGPROBS]


def _score_step(params, cache, batch, sampling, targets, cfg, options, cache_sharding=None, out_sharding=None):
    """A prefill step that also scores every prompt token (prompt_logprobs): all positions' logits."""
    options = dataclasses.replace(options, all_logits=True)
    logits, cache = model_step(params, cache, batch, cfg, options)  # f32[R, B, T, V]
    if cache_sharding is not None:
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding)
    last = jnp.maximum(batch.num_new - 1, 0)[..., None, None]
    sampled = sample(jnp.take_along_axis(logits, last, axis=2)[:, :, 0], sampling, want_logprobs=MAX_LOGPROBS)
    logp = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logp, MAX_LOGPROBS)
    target = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    out = (sampled, PromptScores(target, top_ids, top_logprobs))
    if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out, cache


_score_step_jit = jax.jit(from_buffer(_score_step, 2), static_argnames=(
    "layout", "cfg", "options", "cache_sharding", "out_sharding"), donate_argnums=(1,))


@dataclasses.dataclass
class PackedRows:
    """Rows laid out in a bucket, and where each row landed (to read its samples back)."""

    shape: tuple[int, int, int]  # (batch, tokens, pages)
    batch: StepBatch
    sampling: SamplingTensors
    targets: np.ndarray  # i32[R, B, T]
    where: np.ndarray  # each row's flat index in [R * B]

    def unpack(self, x: np.ndarray) -> np.ndarray:  # x: [R, B, ...] -> [rows, ...]
        return x.reshape((-1,) + x.shape[2:])[self.where]


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
        self.shardings = shardings  # jaxserve.sharding.Shardings or None
        self.num_replicas = cache.num_replicas
        self.num_scheduler_steps = num_scheduler_steps  # > 1: decode buckets get a multi-step variant
        self._executables: dict[tuple, Any] = {}  # (batch, tokens, pages) or (..., "score")
        self._layouts: dict[tuple, Layout] = {}  # how each bucket's inputs are packed
        self.unplanned_compiles = 0  # shapes that were not in the warmed table
        self.closed = False  # close(): executables dropped, params and cache deleted
        # Calls that ran a bucket's executable for the first time: on a CPU such a call takes ~15 ms
        # more than the next ones (measured), so timings of those steps are not representative.
        self.first_runs = 0
        self._ran: set[tuple] = set()
        # Token history for repetition/presence/frequency penalties, padded to one fixed length so
        # penalties never recompile (B x history_len int32s per step: small beside the weights).
        self.history_len = buckets.page_counts[-1] * cache.page_size
        self.compiler_options = step_compiler_options(jax.default_backend())
        # Multi-host, process 0 only: hands each step's packed inputs and each page copy to the other
        # processes before running it (jaxserve.multihost.Leader); None in a single process.
        self.broadcaster: Any = None
        # A mesh spanning processes: the samples are made replicated in the step, since a process can
        # only read the shards on its own devices.
        self.out_sharding = None
        if shardings is not None and shardings.mesh.is_multi_process:
            self.out_sharding = jax.sharding.NamedSharding(shardings.mesh, jax.sharding.PartitionSpec())
        CompileCounter.install()

    # ---- compilation ---------------------------------------------------------------------------
    def step_shapes(self) -> list[tuple]:
        """Every (batch, tokens, pages) the engine may run: decodes and prefill chunks (and their
        multi-step variants); see `buckets.step_shapes`."""
        return bucket_shapes.step_shapes(self.buckets, self.num_scheduler_steps)

    def step_inputs(self, shape: tuple) -> tuple:
        """ShapeDtypeStructs of the host inputs of bucket `shape`, as `run_packed` takes them: (StepBatch,
        SamplingTensors), plus the targets of a scoring variant or each row's step count of a multi-step
        one. (They travel packed: jaxserve.transfer gives the one packed array its sharding.)"""
        B, T, P = shape[:3]
        R = self.num_replicas
        batch = StepBatch(tokens=jax.ShapeDtypeStruct((R, B, T), jnp.int32),
                          start_pos=jax.ShapeDtypeStruct((R, B), jnp.int32),
                          num_new=jax.ShapeDtypeStruct((R, B), jnp.int32),
                          page_table=jax.ShapeDtypeStruct((R, B, P), jnp.int32))
        inputs = (batch, SamplingTensors.spec((R, B), self.history_len))
        if shape[3:] == ("score",):  # each token's next token, scored
            return inputs + (jax.ShapeDtypeStruct((R, B, T), jnp.int32),)
        if shape[3:] == (MULTI_STEP,):  # how many of the decode steps each row takes part in
            return inputs + (jax.ShapeDtypeStruct((R, B), jnp.int32),)
        return inputs

    def score_shapes(self) -> list[tuple]:
        """The prefill shapes again, as prompt-scoring variants (compiled when prompt logprobs are enabled)."""
        return bucket_shapes.score_shapes(self.buckets)

    def _lower(self, shape: tuple):
        cache_sharding = None if self.shardings is None else cache_shardings(
            self.shardings, "int8" if self.cache.quantized else "auto")
        static = dict(cfg=self.cfg, options=self.options, cache_sharding=cache_sharding,
                      out_sharding=self.out_sharding)
        if shape[3:] == (MULTI_STEP,):
            step, static["num_steps"] = _multi_decode_step_jit, self.num_scheduler_steps
        elif shape[3:] == ("score",):
            step = _score_step_jit
        else:
            step = _generate_step_jit
        layout = self._layouts[shape] = Layout.of(self.step_inputs(shape))
        return step.trace(self.params, self.cache, layout.spec(self.buffer_sharding), layout=layout, **static).lower()

    def compile(self, shape: tuple[int, int, int]):
        self.check_open()
        executable = self._executables.get(shape)
        if executable is None:
            executable = self._executables[shape] = self._lower(shape).compile(self.compiler_options)
        return executable

    def warm_up(self, shapes: list[tuple[int, int, int]] | None = None, progress: bool = True) -> list[tuple]:
        """Compile every bucket ahead of time; returns (shape, seconds) per bucket.

        Tracing holds the GIL, so buckets are lowered one by one; XLA compiles them on all cores.
        """
        from concurrent.futures import ThreadPoolExecutor

        from tqdm import tqdm

        shapes = [s for s in (shapes if shapes is not None else self.step_shapes()) if s not in self._executables]
        logger.info("compiling %d step buckets (batch, tokens, pages): %s", len(shapes), shapes)

        def compile_one(shape, lowered):
            start = time.perf_counter()
            executable = lowered.compile(self.compiler_options)
            return shape, executable, time.perf_counter() - start

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool, \
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
        """Call each bucket's executable once on all-zero inputs (every row on the padding page, which
        no sequence owns), so that the ~15 ms a first call costs on a CPU is paid at start-up, not by
        the first request needing that bucket. Same order in every process of a multi-host mesh."""
        for shape in shapes:
            if shape in self._ran:
                continue
            zeros = self._layouts[shape].zeros(self.buffer_sharding)
            _, self.cache = self._executables[shape](self.params, self.cache, zeros)
            self._ran.add(shape)
        jax.block_until_ready(self.cache)

    def copy_pages(self, replica: int, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy pages src[i] -> dst[i] of one replica (forked sequences), in one compiled width."""
        self.check_open()
        if self.broadcaster is not None:
            self.broadcaster.copy_pages(replica, src, dst)
        self.cache = copy_pages_padded(self.cache, replica, src, dst, self.buckets.batch_sizes[-1])

    # ---- execution -----------------------------------------------------------------------------
    def execute(self, rows: Sequence[RowWork]) -> SampleOutput | tuple[SampleOutput, PromptScores]:
        """Run one step for `rows` (any mix of replicas); returns each row's sample, in row order
        (tokens i32[n], logprobs f32[n], top_ids i32[n, MAX_LOGPROBS], top_logprobs f32[n, MAX_LOGPROBS]).

        If any row has `targets`, the step also scores every token (the scoring variant) and returns
        (samples, PromptScores with leading axis n)."""
        score = any(r.targets is not None for r in rows)
        packed = self._pack(rows, score=score)
        inputs = (packed.batch, packed.sampling, packed.targets) if score else (packed.batch, packed.sampling)
        out = self._run(packed.shape + (("score",) if score else ()), inputs)
        return jax.tree.map(packed.unpack, out)

    def execute_multi(self, rows: Sequence[RowWork], steps: Sequence[int]) -> SampleOutput:
        """Run `num_scheduler_steps` decode steps for single-token `rows` in one call; row i takes part
        in its first steps[i] (its pages must hold start_pos + steps[i] tokens). Returns the samples
        with a leading step axis: tokens i32[num_scheduler_steps, n], and so on; a row's samples past
        its steps are meaningless."""
        if not 1 <= max(steps) <= self.num_scheduler_steps:
            raise ValueError(f"steps per row must be in [1, {self.num_scheduler_steps}], got {list(steps)}")
        packed = self._pack(rows, score=False)
        per_row = np.zeros(packed.batch.start_pos.shape, np.int32)
        per_row.reshape(-1)[packed.where] = steps
        out = self._run(packed.shape + (MULTI_STEP,), (packed.batch, packed.sampling, per_row))
        return jax.tree.map(lambda x: x.reshape(x.shape[:1] + (-1,) + x.shape[3:])[:, packed.where], out)

    def _pack(self, rows: Sequence[RowWork], score: bool) -> "PackedRows":
        """Lay rows out in the smallest (batch, tokens, pages) bucket: NumPy arrays with leading [R, B]."""
        R = self.num_replicas
        per_replica = [[i for i, r in enumerate(rows) if r.replica == rep] for rep in range(R)]
        B = pick_bucket(max(len(p) for p in per_replica), self.buckets.batch_sizes)
        max_tokens = max(len(r.tokens) for r in rows)
        T = 1 if max_tokens == 1 and not score else pick_bucket(max_tokens, self.buckets.chunk_sizes)
        P = self.buckets.page_counts[-1] if T > 1 else pick_bucket(
            max(len(r.page_ids) for r in rows), self.buckets.page_counts)
        tokens = np.zeros((R, B, T), np.int32)
        start = np.zeros((R, B), np.int32)
        num_new = np.zeros((R, B), np.int32)
        table = np.full((R, B, P), PADDING_PAGE, np.int32)
        targets = np.zeros((R, B, T), np.int32)
        flat_sampling: list[RowSampling | None] = [None] * (R * B)
        where = np.empty(len(rows), np.int64)  # flat [R*B] index of each row
        for rep, indices in enumerate(per_replica):
            for b, i in enumerate(indices):
                row = rows[i]
                tokens[rep, b, : len(row.tokens)] = row.tokens
                start[rep, b] = row.start_pos
                num_new[rep, b] = len(row.tokens)
                table[rep, b, : len(row.page_ids)] = row.page_ids
                flat_sampling[rep * B + b] = row.sampling
                where[i] = rep * B + b
                if row.targets is not None:
                    targets[rep, b, : len(row.targets)] = row.targets
        batch = StepBatch(tokens=tokens, start_pos=start, num_new=num_new, page_table=table)
        st = SamplingTensors.pack(flat_sampling, (R, B), self.history_len)
        return PackedRows((B, T, P), batch, st, targets, where)

    def _run(self, shape: tuple, inputs: tuple) -> Any:
        if self.broadcaster is None:
            return self.run_packed(shape, inputs)
        self.broadcaster.step(shape, inputs)  # multi-host: the other processes run the same call
        try:
            return self.run_packed(shape, inputs)
        except Exception as err:  # noqa: BLE001 - the processes are out of step: fatal (it exits)
            self.broadcaster.step_failed(err)
            raise

    def run_packed(self, shape: tuple, inputs: tuple) -> Any:
        """Run the compiled step of bucket `shape` on packed host inputs ((StepBatch, SamplingTensors[,
        targets]) of NumPy arrays, leading axes [R, B]); returns the samples on the host, [R, B, ...].
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
        # one host->device copy of the packed inputs, one device->host copy of the samples.
        out, self.cache = executable(self.params, self.cache, self.put_inputs(shape, inputs))
        return jax.device_get(out)

    def put_inputs(self, shape: tuple, inputs: tuple) -> jax.Array:
        """Bucket `shape`'s host inputs packed into one array and copied to the device (sharded over
        the replicas on a mesh) in one transfer; the bucket must have been compiled."""
        return self._layouts[shape].put(inputs, self.buffer_sharding)

    @property
    def buffer_sharding(self) -> Any:
        """The packed inputs' sharding: over the replicas (the `data` axis) on a mesh."""
        return None if self.shardings is None else self.shardings.batch2

    # ---- release -------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop every compiled executable and delete the params' and the KV cache's device buffers;
        afterwards every call raises EngineClosedError. The executables' code is unmapped once JAX's
        in-memory compilation cache lets go of them too (`compile.release_compiled_code`, which
        `LLMEngine.close` calls after this)."""
        if self.closed:
            return
        self.closed = True
        self._executables.clear()
        self._layouts.clear()
        self._ran.clear()
        delete_buffers((self.params, self.cache))
        self.params = self.cache = None

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
