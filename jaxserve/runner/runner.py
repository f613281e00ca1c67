"""The model runner: lays a step's rows out, runs its executable, hands back its samples.

It is the only place where host state becomes device arrays. Each kind of step is a variant
(`step_variant.StepVariant`: plain, prompt scoring, multi-step, speculative) that owns its inputs,
lowering, packing and unpacking; the runner asks the variants in order which one runs a step's rows,
and runs the executable the table (`executables.ExecutableTable`) holds for that variant's bucket.
One concern, one helper: the device buffers (`DeviceState`), the transfers (`InputTransfer`), the
executables (`ExecutableTable`), LoRA's device slots (`runner/lora.py`), the other processes of a
multi-host job (`peers`: `runner/multihost.py`'s leader, or none).
"""

from __future__ import annotations

import logging
import math
import types
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine.buckets import BucketTable, opening_buckets
from jaxserve.errors import EngineClosedError
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.transfer import Layout
from jaxserve.model.weights import Params
from jaxserve.runner.compilation import CompileCounter, release_compiled_code, step_compiler_options
from jaxserve.runner.executables import ExecutableTable
from jaxserve.runner.input_transfer import InputTransfer
from jaxserve.runner.multihost import NoPeers
from jaxserve.runner.plain_steps import MultiStep, PlainStep, ScoreStep
from jaxserve.runner.running_batch import RunningBatch
from jaxserve.runner.speculative import SpeculativeStep
from jaxserve.runner.step_io import PendingSamples, StepInputs, StepSamples, split_sparse
from jaxserve.runner.step_row import StepRow
from jaxserve.runner.step_variant import DeviceState, StepContext, StepVariant
from jaxserve.model.step_options import StepOptions

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns params and the KV cache (`state`); runs one step at a time in the variant its rows need."""

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
        self.ctx = ctx = StepContext(
            cfg, options, buckets, cache.num_replicas, cache.page_size, shardings, cache.quantized, num_scheduler_steps
        )
        self.cfg, self.buckets, self.options, self.shardings = cfg, buckets, options, shardings
        self.num_replicas, self.history_len, self.grammar_masks = ctx.num_replicas, ctx.history_len, ctx.grammar_masks
        carried = jax.device_put(np.zeros((ctx.num_replicas, buckets.max_rows), np.int32), ctx.carry_sharding)
        self.state = DeviceState(params, cache, carried)
        self.platform = jax.default_backend()
        self.transfer = InputTransfer(ctx.num_replicas, ctx.history_len, ctx.buffer_sharding)
        self.table = ExecutableTable(self._lower, step_compiler_options(self.platform), self.platform)
        self.score, self.plain = ScoreStep(ctx), PlainStep(ctx, self.transfer.idle_host)
        # Asked in order which variant runs a step's rows; the first that accepts does. The ones after
        # `score` are what warm-up compiles.
        self.variants: list[StepVariant] = [self.score, MultiStep(ctx), self.plain]
        self.batch = RunningBatch(multi_step=num_scheduler_steps > 1)  # the running rows, by slot
        self.peers: Any = NoPeers()  # multi-host process 0: runner/multihost.Leader
        # Checks before every engine step, each raising what stops it (weights a trainer deleted since).
        self.before_step: list[Callable[[], None]] = []
        self.speculation: SpeculativeStep | None = None  # enable_speculation
        self.lora: Any = None  # enable_lora: runner.lora.LoRASlots
        self._lora_writes = 0  # the slot write's executable, once LoRA is served
        self.compiles_at_warm_up: int | None = None  # CompileCounter.foreground() once warmed up
        self.background: Any = None  # runner/background_compile.BackgroundCompile: buckets compiling after start-up
        self.page_io: Any = None  # enable_page_io: runner/page_io.PageIO, for a KV connector
        self.closed = False  # close(): executables dropped, params and cache deleted
        CompileCounter.install()

    # The device state's buffers, by their names (research code and the LoRA manager replace params).
    params = property(lambda self: self.state.params, lambda self, v: setattr(self.state, "params", v))
    cache = property(lambda self: self.state.cache, lambda self, v: setattr(self.state, "cache", v))
    carried = property(lambda self: self.state.carried, lambda self, v: setattr(self.state, "carried", v))
    first_runs = property(lambda self: self.table.first_runs, lambda self, v: setattr(self.table, "first_runs", v))
    unplanned_compiles = property(lambda self: self.table.unplanned_compiles)
    last_sparse = property(lambda self: self.transfer.last_sparse)
    buffer_sharding = property(lambda self: self.ctx.buffer_sharding)

    def enable_lora(self, slots: Any) -> None:
        """Serve LoRA adapters: every layer's params get `slots`' resident stacks (zeros), and each step
        a row slot input (`RaggedBatch.row_lora`). Before any step is compiled: the steps take the
        stacks as part of the params. The slot write is compiled here (an empty adapter into slot 0),
        so loading adapters later compiles nothing."""
        if len(self.table):
            raise RuntimeError("enable_lora must come before the steps are compiled")
        self.lora, self.ctx.lora, self._lora_writes = slots, True, 1
        self.params = slots.write(slots.attach(self.params), 0, NO_ADAPTER)

    def write_lora(self, slot: int, adapter: Any) -> None:
        """Put `adapter` (a `lora.peft_adapter.PeftAdapter`) into device slot `slot`: queued behind the
        steps already dispatched, so they still read the slot's old adapter."""
        self.check_open()
        self.params = self.lora.write(self.params, slot, adapter)

    def enable_speculation(self, method: str, num_tokens: int, draft: Any = None) -> SpeculativeStep:
        """Every ragged bucket runs as a speculative step (for the draft method, with the loaded
        `draft` model's params and a cache of its own over the same page ids)."""
        self.speculation = SpeculativeStep(self.ctx, self.state, method, num_tokens, draft)
        self.variants = [self.score, self.speculation]
        self.batch = RunningBatch(draft_model=method == "draft")
        return self.speculation

    # ---- compilation ---------------------------------------------------------------------------
    def _variant_of(self, key: tuple) -> StepVariant:
        return next(v for v in self.variants if v.owns(key))

    def step_shapes(self) -> list[tuple]:
        """Every executable warm-up compiles: each variant's after `score` (see `buckets.step_shapes`)."""
        return [key for variant in self.variants[1:] for key in variant.keys()]

    def score_shapes(self) -> list[tuple]:
        """The prompt-scoring variant's executables (compiled when prompt logprobs are enabled)."""
        return self.score.keys()

    def num_logits(self, num_tokens: int) -> int:
        return self.ctx.num_logits(num_tokens)

    def step_inputs(self, key: tuple) -> tuple:
        """ShapeDtypeStructs of executable `key`'s host inputs, as `run_step` takes them."""
        return self._variant_of(key).input_specs(key)

    def _lower(self, key: tuple) -> tuple[Any, Layout]:
        packed, fields = split_sparse(self.step_inputs(key))
        layout = Layout.of(packed)
        sparse = tuple(
            jax.ShapeDtypeStruct((f.shape[0], math.prod(f.shape[1:])), f.dtype, sharding=self.ctx.buffer_sharding)
            for f in fields
        )
        return self._variant_of(key).lower(key, self.state, layout, sparse), layout

    def compile(self, key: tuple) -> Any:
        self.check_open()
        return self.table.get(key)

    def warm_up(self, shapes: list[tuple] | None = None, progress: bool = True) -> list[tuple]:
        """Compile every executable ahead of time and run those `run_at_warm_up` picks once; returns
        (key, seconds) per executable compiled."""
        keys = shapes if shapes is not None else self.step_shapes()
        timings = self.table.compile_all(keys, progress)
        self.run_each_once(self.run_at_warm_up(keys))
        return timings

    def run_at_warm_up(self, keys: Sequence[tuple]) -> list[tuple]:
        """The executables warm-up runs once: every one on an accelerator, where a step costs
        milliseconds and running each proves the memory plan before a request does; on a CPU only the
        opening buckets' (a lone decode's, every row's decode), whose latency the first requests see.
        There a large bucket's step costs its padded tokens (seconds for a 1B model, ~1 s for the
        default model's 256 tokens in float32) to save its first call's ~15 ms once, and host memory
        is not a preallocated pool. The choice depends on the settings alone, so every process of a
        mesh runs the same executables in the same order."""
        if jax.default_backend() != "cpu":
            return list(keys)
        opening = set(opening_buckets(self.buckets))
        return [key for key in keys if key[0] in opening]

    def run_each_once(self, keys: Sequence[tuple]) -> None:
        """Call each executable once on all-zero inputs (every token's K/V to slot 0, on the padding
        page, which no sequence owns), so that the ~15 ms a first call costs on a CPU is paid at
        start-up. Same order in every process of a multi-host mesh."""
        for key in keys:
            if key not in self.table.ran:
                zeros = self.table.layouts[key].zeros(self.ctx.buffer_sharding)
                self._call(key, self.table.executables[key], self.transfer.idle(self.num_logits(key[0])), zeros)
                self.table.ran.add(key)
        jax.block_until_ready(self.cache)

    def warm_up_page_copies(self) -> None:
        """Compile the page copy of forked (n > 1) sequences, one per replica (and a KV connector's page
        read and write)."""
        for replica in range(self.num_replicas):
            self.copy_pages(replica, np.zeros(0, np.int32), np.zeros(0, np.int32))
        if self.page_io is not None:
            self.page_io.warm_up(self.num_replicas)

    def enable_page_io(self) -> Any:
        """Whole pages between the KV cache and host memory (`runner/page_io.PageIO`) for a KV connector."""
        from jaxserve.runner.page_io import PageIO

        if self.page_io is None:
            self.page_io = PageIO(self.state)
        return self.page_io

    def num_executables(self) -> int:
        """Compiled executables: every variant's steps, the LoRA slot write, and the page copy of
        forked sequences (one per replica and KV cache, once compiled)."""
        if self.closed:
            return 0
        copies = self.num_replicas * len(self.state.caches()) if self.compiles_at_warm_up is not None else 0
        page_io = self.page_io.num_executables if self.page_io is not None else 0
        return len(self.table) + self._lora_writes + copies + page_io

    def stats(self) -> dict:
        return dict(
            compiles_after_warmup=(CompileCounter.foreground() - self.compiles_at_warm_up)
            if self.compiles_at_warm_up is not None
            else None,
            executables=self.num_executables(),
            **(self.background.stats() if self.background is not None else self._bucket_stats()),
            # structured output: host time computing grammar masks, and the constrained rows masked
            grammar_mask_seconds_total=self.grammar_masks.seconds,
            grammar_masked_rows_total=self.grammar_masks.rows,
        )

    def _bucket_stats(self) -> dict:
        """Token buckets ready and their build seconds when all were compiled at start-up."""
        total = len(self.buckets.token_counts)
        built = self.table.compiled + self.table.loaded
        return dict(
            buckets_ready=total if self.compiles_at_warm_up is not None else 0,
            buckets_total=total,
            bucket_compile_seconds=sum(seconds for _, seconds in built),
        )

    def copy_pages(self, replica: int, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy pages src[i] -> dst[i] of one replica (forked sequences) in every KV cache."""
        self.check_open()
        self.peers.copy_pages(replica, src, dst)
        self.state.copy_pages(replica, src, dst, self.buckets.batch_sizes[-1])

    # ---- execution -----------------------------------------------------------------------------
    def prepare_inputs(self, rows: Sequence[StepRow]) -> StepInputs:
        """Lay a step's rows out on the host (nothing is sent yet) in the first variant that takes
        them. A row's tokens may hold placeholders of the previous step's samples
        (jaxserve.model.placeholders); a constrained row's grammar already took the tokens before them."""
        variant = next(v for v in self.variants if v.accepts(rows))
        key = variant.key_for(rows)
        return variant.pack(rows, key, self.table.layout(key))

    def execute(self, update: Any, sent_masks: dict | None = None) -> PendingSamples:
        """One step of the engine: apply the scheduler's `BatchUpdate` to the running batch, lay the
        step's rows out, run it on the device (not waiting for it) and start its samples' copy to the
        host (their logprobs only when a row asked for them). The other processes of a multi-host job
        get the update (and the constrained rows' masks) and make the same call; a follower passes
        those masks as `sent_masks` (row index -> `update_codec.SentMask`)."""
        for check in self.before_step:
            check()
        rows = self.batch.apply(update)
        for i, mask in (sent_masks or {}).items():
            rows[i].grammar = mask
        packed = self.prepare_inputs(rows)
        self.peers.execute(update, rows, packed)
        return self._pending(packed, self._run(packed.shape, packed.inputs, packed.buffer), update.logprobs)

    def execute_rows(self, rows: Sequence[StepRow]) -> StepSamples:
        """One step of rows the caller describes whole (research code, tests, benchmarks), run to
        completion; the engine's running batch is left as it is."""
        packed = self.prepare_inputs(rows)
        return self._pending(packed, self.run_step(packed.shape, packed.inputs, packed.buffer), True).result()

    def _pending(self, packed: StepInputs, out: Any, logprobs: bool) -> PendingSamples:
        variant = self._variant_of(packed.shape)
        return PendingSamples(variant.fetched(out, logprobs), packed, variant.unpack, start_copy=self.platform != "cpu")

    def run_step(self, key: tuple, inputs: tuple, buffer: np.ndarray | None = None) -> Any:
        """Dispatch executable `key` on host inputs (arrays, leading axis R); returns its outputs on
        the device (not waited for). `buffer`: the inputs but the sparse ones already packed (an
        InputBatch's). The other processes of a multi-host job get the inputs first and make the same
        call (`multihost.follower_loop`)."""
        self.peers.step(key, inputs)
        return self._run(key, inputs, buffer)

    def _run(self, key: tuple, inputs: tuple, buffer: np.ndarray | None) -> Any:
        try:
            return self._dispatch(key, inputs, buffer)
        except Exception as err:  # noqa: BLE001 - the processes are out of step: fatal (it exits)
            self.peers.step_failed(err)
            raise

    def _dispatch(self, key: tuple, inputs: tuple, buffer: np.ndarray | None) -> Any:
        # Explicit transfers only (the step loop runs under jax.transfer_guard("disallow") in tests):
        # one host->device copy of the packed inputs (and one of the sparse sampling inputs when a
        # row uses penalties or logit_bias); the samples' copy back is the caller's.
        self.check_open()
        executable = self.table.get(key, planned=False)
        self.table.first_run(key)
        packed, fields = split_sparse(inputs)
        sparse = self.transfer.put_sparse(self.num_logits(key[0]), fields)
        staged = None
        if buffer is None:
            buffer = self.table.layouts[key].pack(packed)
        else:  # a copy: the input batch rewrites its buffer for the next step, and a CPU device may alias it
            staged, buffer = self.transfer.stage(key, buffer)
        out = self._call(key, executable, sparse, buffer)
        if staged is not None:
            staged[1] = jax.tree.leaves(out)[0]  # ready once the step is done: then nothing reads that copy
        return out

    def _call(self, key: tuple, executable: Any, sparse: tuple, buffer: Any) -> Any:
        """Call an executable, its variant replacing the donated caches and the carried samples.
        `buffer`: the packed inputs, on the device or a NumPy array. In one process a NumPy buffer is
        the call's operand, and the executable's own argument handling copies it to the device: the
        same one transfer as `put_buffer`, without jax.device_put's Python path (~20 us on an idle
        CPU, 150-350 us of the host's time beside a running step on 2 shared cores:
        `docs/BENCHMARKS.md`). On a mesh spanning processes each process puts its own shards."""
        if isinstance(buffer, np.ndarray) and self.ctx.out_sharding is not None:
            buffer = self.transfer.put_buffer(buffer)
        with jax.transfer_guard_host_to_device("allow"):  # the packed inputs: this step's one copy in
            return self._variant_of(key).call(executable, self.state, sparse, buffer)

    def probe_rows(self, rows: Sequence[Any]) -> Callable[[], Any]:
        """`probe` of the step these rows pack into (rows on the padding page, which no sequence
        owns): what speculation times its steps with."""
        packed = self.prepare_inputs(rows)
        return self.probe(packed.shape, packed.inputs)

    def probe(self, key: tuple, inputs: tuple) -> Callable[[], Any]:
        """A callable that runs executable `key` on these host inputs (rows on the padding page) and
        returns its outputs, for timing: the inputs are copied to the device once, here."""
        executable = self.compile(key)
        packed, fields = split_sparse(inputs)
        sparse, buffer = self.transfer.put_sparse(self.num_logits(key[0]), fields), self.put_inputs(key, packed)
        self.table.first_run(key)

        def run():
            self.peers.step(key, inputs)
            return self._call(key, executable, sparse, buffer)

        return run

    def put_inputs(self, key: tuple, inputs: tuple) -> jax.Array:
        """Executable `key`'s host inputs but the sparse ones packed and copied to the device in one
        transfer (sharded over the replicas on a mesh)."""
        return self.transfer.put_buffer(self.table.layouts[key].pack(inputs))

    def put_buffer(self, host: np.ndarray) -> jax.Array:
        return self.transfer.put_buffer(host)

    # ---- release -------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop every compiled executable and delete the device buffers (the draft's too); afterwards
        every call raises EngineClosedError. The executables' code is unmapped once JAX's in-memory
        compilation cache lets go of them too (`compilation.release_compiled_code`)."""
        if self.closed:
            return
        self.closed = True
        if self.background is not None:  # before the table goes: nothing compiles after close
            self.background.stop()
        self.table.clear()
        self.transfer.clear()
        self.batch.clear()
        for variant in self.variants:
            variant.clear()
        self.state.delete()
        release_compiled_code()

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError(
                "this engine is closed (its executables, weights and KV cache are released); build a new one"
            )


# What `enable_lora` compiles the slot write with: an adapter of no modules (zeros everywhere).
NO_ADAPTER = types.SimpleNamespace(modules={})
