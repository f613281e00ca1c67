"""LLMEngine: step() = schedule -> run -> postprocess; AsyncLLMEngine: the same loop on a background
thread, streaming each request's progress to an async iterator."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.runner import multihost
from jaxserve.engine.arrival_window import ArrivalWindow
from jaxserve.runner.backends import default_scan_layers, resolve_attention, resolve_quantized_matmul
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.buckets import BucketTable, executable_counts
from jaxserve.runner.compilation import (CompileCounter, check_memory_mappings, enable_compilation_cache,
                                     release_compiled_code)
from jaxserve.runner.runner import ModelRunner, PendingSamples, RowWork
from jaxserve.engine.scheduler import ScheduledRow, Scheduler, SchedulerOutput
from jaxserve.engine.output_processor import OutputProcessor, Request, stream_deltas
from jaxserve.engine.sequence import Sequence, TokenView
from jaxserve.engine.step_stats import StepComposition, is_prompt_chunk
from jaxserve.errors import EngineClosedError, RequestError
from jaxserve.model.kv_cache import init_cache
from jaxserve.planning.memory import plan_memory
from jaxserve.model.weights import param_bytes
from jaxserve.loading.model_loader import load_model
from jaxserve.model.ragged import is_placeholder, placeholder
from jaxserve.model.sampler import RowSampling, SampleOutput
from jaxserve.sampling.params import RequestOutput, SamplingParams
from jaxserve.model.sharding import make_mesh
from jaxserve.spec_decode.decoder import draft_kv_bytes_per_token
from jaxserve.steps import StepOptions

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class LaunchedStep:
    """A dispatched step whose samples the host has not processed yet; per row: the output index its
    sampled token fills (-1: the row does not sample), its sequence's computed tokens once the step
    is done, and the sequence's preemption count at dispatch (a preempted one lost those pages)."""

    plan: SchedulerOutput
    rows: list[RowWork]
    pending: PendingSamples
    constrained: bool = False  # a row samples under a grammar
    dispatched_at: float = 0.0  # time.perf_counter() when its dispatch returned
    samples: Any = None  # what `pending` returned, once fetched
    sample_at: list[int] = dataclasses.field(default_factory=list)
    computed: list[int] = dataclasses.field(default_factory=list)  # -1: told to the block manager at dispatch
    preemptions: list[int] = dataclasses.field(default_factory=list)


class LLMEngine:
    """Continuous batching over the paged cache. Not thread-safe: AsyncLLMEngine serialises calls."""

    def __init__(self, settings: EngineConfig, warm_up: bool = True):
        self.settings = s = settings
        multihost.initialize(s)  # num_processes > 1: jax.distributed, before any device is touched
        cache_path = enable_compilation_cache(s.compilation_cache_dir)
        logger.info("persistent compilation cache: %s", cache_path or "off")
        self.mesh = make_mesh(s.mesh_shape)
        scan = s.scan_layers if s.scan_layers is not None else default_scan_layers(jax.default_backend())
        loaded = load_model(s, self.mesh, stacked=scan)
        self.model_config, self.dtype, self.shardings = loaded.cfg, loaded.dtype, loaded.shardings
        self.num_replicas = self.shardings.num_replicas
        self.plan = plan_memory(loaded.cfg, s, loaded.dtype,
                                draft_kv_bytes_per_token=draft_kv_bytes_per_token(s, loaded.dtype))
        logger.info(self.plan.describe())
        logger.info(self.plan.capacity_line())
        if param_bytes(loaded.params) != self.plan.param_bytes:
            logger.warning("loaded params take %d bytes; the config's arithmetic says %d",
                           param_bytes(loaded.params), self.plan.param_bytes)
        self.tokenizer = self._load_tokenizer(loaded.model_dir)
        eos = (self.tokenizer.eos_token_ids if self.tokenizer is not None and self.tokenizer.eos_token_ids
               else loaded.cfg.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, eos, self.plan.max_model_len)
        attention = resolve_attention(s.attention_backend, jax.default_backend(), s.mesh_shape)
        matmul = resolve_quantized_matmul(s.quantized_matmul_backend, jax.default_backend(), s.mesh_shape,
                                          s.quantization)
        options = StepOptions(scan_layers=scan, attention_backend=attention, mesh=self.mesh, matmul_backend=matmul,
                              moe_parallelism=s.moe_parallelism)
        self.buckets = BucketTable.for_settings(s, self.plan.max_model_len, jax.default_backend())
        logger.info("token buckets (token_buckets=%s on %s): %s", s.token_buckets, jax.default_backend(),
                    ", ".join(map(str, self.buckets.token_counts)))
        cache = init_cache(loaded.cfg, self.plan.num_pages, s.page_size, loaded.dtype, self.num_replicas,
                           self.shardings.cache, s.kv_cache_dtype, self.shardings.cache_scale)
        self.runner = ModelRunner(loaded.cfg, loaded.params, cache, self.buckets, options, self.shardings,
                                  num_scheduler_steps=s.num_scheduler_steps)
        # Every layer windowed (Mistral): pages wholly behind the window go back to the pool. Not with a
        # draft model, whose cache shares the page ids and need not be windowed.
        cfg = loaded.cfg
        windowed = cfg.sliding_window and cfg.num_sliding_layers == cfg.num_layers and s.speculation != "draft"
        self.blocks = BlockManager(self.plan.num_pages, s.page_size, self.num_replicas,
                                   enable_prefix_caching=s.enable_prefix_caching,
                                   sliding_window=cfg.sliding_window if windowed else None)
        self.scheduler = Scheduler(self.blocks, self.buckets, s.max_num_seqs, s.max_num_batched_tokens,
                                   self.plan.max_model_len,
                                   scheduling=s.scheduling, preemption_mode=s.preemption_mode)
        self.spec = self._speculative_decoder(loaded) if s.speculation else None
        if s.num_scheduler_steps > 1:  # pages for the extra decode steps, where free ones exist
            # A step of decodes alone runs them num_scheduler_steps in one call; a step holding a
            # prompt chunk is one plain mixed ragged step, as in every engine.
            self.scheduler.lookahead = self._multi_step_lookahead
            self.scheduler.lookahead_steps = True
        # Async scheduling: step N+1 dispatched before step N's samples are processed (self.step).
        # Speculation's acceptance and multi-step's run lengths decide the next inputs on the host.
        self.async_scheduling = s.async_scheduling and self.scheduler.lookahead is None
        if s.async_scheduling and not self.async_scheduling:
            logger.info("async scheduling off: %s engines run each step to completion first",
                        "speculative" if self.spec is not None else "multi-step")
        self._in_flight: LaunchedStep | None = None
        # Async scheduling: requests that arrive while step N runs may still join step N+1, which is
        # held back until just before N should end (engine/arrival_window.py). `arrivals(pending,
        # until)` waits for them until `until` (time.perf_counter) or until step N is done (its
        # PendingSamples), adds those that came and returns how many: AsyncLLMEngine sets it;
        # offline, every request is added before the steps run and nothing is held back.
        self.arrivals: Callable[[PendingSamples, float], int] | None = None
        self.arrival_window = ArrivalWindow()
        self.requests: dict[str, Request] = {}
        self._grammar_compiler = None  # structured output: made on the first constrained request
        self._grammar_lock = threading.Lock()
        self._seed_stream = np.random.default_rng(s.seed)
        self.counters = dict(prompt_tokens=0, generation_tokens=0, prefill_tokens_computed=0, steps=0,
                             arrivals_joined=0)
        self.composition = StepComposition(self.buckets.token_counts)
        self.last_step_seconds = 0.0
        self.last_step_bytes_read = 0
        self.compiles_at_warm_up = self.warm_up_compiles = None
        self.closed = False
        if warm_up:
            self.warm_up()
        # Multi-host: process 0 hands every later device call to the other processes, which run
        # multihost.run_follower(engine) instead of serving (None in a single process and on followers).
        self.multihost = multihost.attach(self)

    def warm_up(self) -> None:
        before = CompileCounter.requests
        self.runner.warm_up()
        if self.settings.enable_prompt_logprobs:
            self.runner.warm_up(self.runner.score_shapes())
        for replica in range(self.num_replicas):  # the page copy of forked (n > 1) sequences
            self.runner.copy_pages(replica, np.zeros(0, np.int32), np.zeros(0, np.int32))
        if self.spec is not None:
            self.spec.warm_up()
        self.compiles_at_warm_up = CompileCounter.requests
        planned = executable_counts(self.settings, self.plan.max_model_len, self.num_replicas, jax.default_backend())
        self.warm_up_compiles = self.compiles_at_warm_up - before  # executables asked for (persistent-cache hits too)
        logger.info("warm-up compiled %d executables; the bucket table plans %s", self.warm_up_compiles,
                    planned.describe())
        check_memory_mappings(jax.default_backend())

    def num_executables(self) -> int:
        """Compiled executables this engine holds: its step buckets and their variants, the speculative
        steps, and the page copy of forked sequences (one per replica and KV cache, once compiled)."""
        if self.closed:
            return 0
        copies = self.num_replicas * (2 if self.settings.speculation == "draft" else 1)
        return len(self.runner._executables) + (copies if self.compiles_at_warm_up is not None else 0)

    # ---- release -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release this engine's executables, weights and KV cache now (idempotent). On a CPU every
        executable's code is mapped into the process, and Linux caps a process's mappings
        (vm.max_map_count): close an engine before building the next (`with LLM(...) as llm:`).
        Afterwards every call raises EngineClosedError."""
        if self.closed:
            return
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self._in_flight = None
        self.closed = True
        if self.multihost is not None:  # process 0: the other processes stop their follower loops
            self.multihost.shutdown()
        if self.spec is not None:
            self.spec.close()
        self.runner.close()
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()
        release_compiled_code()

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this engine is closed (its executables, weights and KV cache are released); "
                                    "build a new one")

    def _speculative_decoder(self, loaded):
        """Speculative decoding (jaxserve.spec_decode): the draft shares the pages and page tables."""
        from jaxserve.spec_decode import SpeculativeDecoder, load_draft

        s = self.settings
        draft = None
        if s.speculation == "draft":
            draft = load_draft(s, self.mesh, self.runner.options.scan_layers, loaded.cfg, self.tokenizer, self.dtype)
        spec = SpeculativeDecoder(s, self.runner, self.blocks, self.buckets, self.plan.max_model_len, draft)
        self.scheduler.lookahead = spec.lookahead
        return spec

    def _load_tokenizer(self, model_dir: str):
        from jaxserve.loading.tokenizer import load_tokenizer

        path = self.settings.tokenizer or model_dir
        try:
            return load_tokenizer(path)
        except FileNotFoundError:
            if self.settings.tokenizer is not None:
                raise
            logger.warning("no tokenizer in %s: only prompt_token_ids can be given, and outputs have no text", path)
            return None

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: pass prompt_token_ids, or start with tokenizer=PATH")
        return self.tokenizer.encode(prompt)

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Refuse at once what could never be served (rather than hang or fail inside XLA)."""
        self._check_open()
        vocab = self.model_config.vocab_size
        if not ids:
            raise RequestError("a prompt must have at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in (params.logit_bias or ()) if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"logit_bias token id(s) {bad[:5]} are outside the vocabulary [0, {vocab})")
        limit = self.plan.max_model_len
        if len(ids) >= limit:
            raise RequestError(f"prompt of {len(ids)} tokens leaves no room to generate within max_model_len={limit}")
        needed = self.blocks.pages_for(min(len(ids) + params.max_tokens, limit))
        if self.blocks.sliding_window is not None:  # decode pages behind the window go back to the pool
            needed = min(needed, self.blocks.pages_for(len(ids)) + self.blocks.pages_for(self.blocks.sliding_window) + 1)
        usable = self.plan.num_pages - 1 - self.blocks.watermark_pages
        if needed > usable:
            raise RequestError(f"prompt + max_tokens needs {needed} KV pages; a replica's cache has {usable}")
        if params.n > self.settings.max_num_seqs:
            raise RequestError(f"n={params.n} exceeds max_num_seqs={self.settings.max_num_seqs}")
        forked = self.blocks.pages_for(len(ids)) + params.n - 1  # the n samples fork with a page each
        if forked > usable:
            raise RequestError(f"n={params.n} samples of a {len(ids)}-token prompt need {forked} KV pages to start; "
                               f"a replica's cache has {usable}")
        if params.structured is not None:
            if self.settings.speculation:
                # Verification would need the grammar's masks at every drafted position (and a rollback
                # of rejected drafts); until the speculative step takes them, the two are exclusive.
                raise RequestError("structured output is not supported with speculative decoding "
                                   f"(speculation={self.settings.speculation!r}); start the engine without it")
            if self.tokenizer is None:
                raise RequestError("structured output needs the model's tokenizer (start with tokenizer=PATH)")
        if params.prompt_logprobs is not None and not self.settings.enable_prompt_logprobs:
            raise RequestError("prompt_logprobs needs the engine started with enable_prompt_logprobs=True "
                               "(--enable-prompt-logprobs), which compiles the scoring steps")

    def prepare_request(self, prompt: str | None, sampling_params: SamplingParams | None,
                        prompt_token_ids: list[int] | None) -> tuple[list[int], SamplingParams]:
        """A request's prompt ids and params, checked (RequestError for what could never be served).
        Reads only the settings, the tokenizer and the cache's size, so any thread may call it."""
        if (prompt is None) == (prompt_token_ids is None):
            raise RequestError("give exactly one of prompt or prompt_token_ids")
        params = sampling_params or SamplingParams()
        ids = self.encode(prompt) if prompt is not None else [int(t) for t in prompt_token_ids]
        self.check_request(ids, params)
        return ids, params

    @property
    def grammar_compiler(self):
        """The structured-output GrammarCompiler (jaxserve.structured) for this model's tokenizer and
        logits width: compiles on its own thread, caches by spec. Any thread may use it."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise RequestError("structured output needs the model's tokenizer (start with tokenizer=PATH)")
                from jaxserve.structured import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer, vocab_size=self.model_config.vocab_size)
            return self._grammar_compiler

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        grammar=None,
    ) -> None:
        """Queue a request. `grammar`: its CompiledGrammar when the caller compiled `structured` already
        (AsyncLLMEngine does, off the step thread); otherwise it is compiled here (cached by spec), and
        a spec the grammar library rejects raises GrammarError (a RequestError)."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        ids, params = self.prepare_request(prompt, sampling_params, prompt_token_ids)
        if params.structured is not None and grammar is None:
            grammar = self.grammar_compiler.compile(params.structured)
        base_seed = params.seed if params.seed is not None else int(self._seed_stream.integers(2**32))
        seqs = [
            Sequence(
                seq_id=f"{request_id}#{i}", request_id=request_id, index=i, prompt_token_ids=list(ids),
                params=params, seed=(base_seed + 0x9E3779B9 * i) % 2**32,
                detokenizer=self.outputs.detokenizer(ids, params),
            )
            for i in range(params.n)
        ]
        seqs[0].num_siblings_to_fork = params.n - 1
        if params.structured is not None:
            seqs[0].grammar = grammar.matcher()
            for seq in seqs[1:]:  # the samples fork before their first token: each from the start state
                seq.grammar = seqs[0].grammar.copy()
        if params.prompt_logprobs is not None:
            seqs[0].prompt_logprobs = [None] * len(ids)
        self.requests[request_id] = Request(request_id, prompt, list(ids), params, seqs, time.monotonic())
        self.scheduler.add(seqs[0])
        if params.n > 1:
            self.scheduler.add_siblings(seqs[0], seqs[1:])
        self.counters["prompt_tokens"] += len(ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; returns its last delta (finish_reason 'abort')."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                if seq.index == 0:
                    self.scheduler.drop_siblings(seq)
                self.scheduler.finish(seq, "abort")
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a step in flight still to process."""
        return bool(self.requests) or self._in_flight is not None

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, dispatch the compiled step, and return a delta for each request that advanced:
        a RequestOutput holding only what is new (token ids, text, logprob entries, finish reason; sum
        them with output_processor.OutputAccumulator, as LLM.generate does).

        With async scheduling the step whose samples are processed is the previous one: step N+1 is
        scheduled and dispatched before step N's samples are fetched (its inputs take them on the
        device, as placeholders), so the host's work on step N overlaps the device's on step N+1.
        Under AsyncLLMEngine step N+1 is held back until just before step N should end, so that a
        request arriving meanwhile joins it (`_join_arrivals`)."""
        self._check_open()
        start = time.perf_counter()
        outputs = []
        if self._in_flight is not None and not self.async_scheduling:
            outputs = self.flush()  # a step left in flight when async scheduling was switched off
        plan = self.scheduler.schedule()
        self._copy_forked_pages(plan)
        # Speculative and multi-step engines run serially: nothing is ever in flight here.
        if plan.rows and self.spec is not None:
            return outputs + self._speculative_step(plan, start)
        # Lookahead is only ever given where the scheduler has a lookahead policy (multi-step).
        if (plan.rows and plan.kind == "decode" and self.scheduler.lookahead is not None
                and any(r.num_lookahead for r in plan.rows)):
            self.composition.record(plan.rows)
            return outputs + self._multi_step(plan, start)
        before_masks = None
        if self._in_flight is not None and self._in_flight.constrained:
            # Rows under a grammar: the next step's masks need these tokens. Their grammars take them
            # once the rest of the next step is packed (the device idles only while the masks are
            # filled); the rest of this step's processing overlaps the next step, as for free rows.
            before_masks = functools.partial(self._advance_grammars, self._in_flight)
        hold_for = self._in_flight if self.async_scheduling else None
        launched = self._launch(plan, before_masks, hold_for=hold_for) if plan.rows else None
        if not self.async_scheduling:
            return outputs + (self._process(launched, start) if launched is not None else [])
        previous, self._in_flight = self._in_flight, launched
        return outputs + (self._process(previous, start) if previous is not None else [])

    def flush(self) -> list[RequestOutput]:
        """Process the step in flight now (async scheduling), so that every sampled token is on the
        host; returns the requests it advanced."""
        self._check_open()
        previous, self._in_flight = self._in_flight, None
        return self._process(previous, time.perf_counter()) if previous is not None else []

    def _launch(self, plan: SchedulerOutput, before_masks=None, rows: list[RowWork] | None = None,
                hold_for: LaunchedStep | None = None) -> "LaunchedStep":
        """Pack and dispatch the plan's step (not waiting for it); each row that samples gets a
        placeholder for its token, and its tokens so far count as computed, so the next step can be
        scheduled at once. `before_masks`: see ModelRunner.pack; `rows`: the plan's RowWork when
        the caller has built it; `hold_for`: the step in flight, for which the dispatch may be held
        back while requests arrive (`_join_arrivals`)."""
        rows = self._row_work(plan.rows) if rows is None else rows
        packed = self.runner.pack(rows, before_masks)
        joined = self._join_arrivals(plan, hold_for) if hold_for is not None else []
        if joined:
            self.counters["arrivals_joined"] += len(joined)
            rows = rows + self._row_work(joined)
            packed = self.runner.pack(rows)
        self.composition.record(plan.rows)  # with the rows that joined; before the rows take placeholders
        logprobs = False
        context = 0  # what the step had to read: every weight once, plus each row's cached K/V
        for r in plan.rows:
            logprobs = logprobs or r.seq.params.logprobs is not None
            context += r.start + r.num_tokens
        sent = time.perf_counter()
        pending = self.runner.dispatch(packed, logprobs=logprobs)
        dispatched_at = time.perf_counter()
        self.arrival_window.dispatched(dispatched_at - sent)
        self.last_step_bytes_read = self.plan.param_bytes + context * self.plan.kv_bytes_per_token
        step = LaunchedStep(plan, rows, pending, constrained=any(r.grammar is not None for r in rows),
                            dispatched_at=dispatched_at)
        computed, preemptions, sample_at = step.computed, step.preemptions, step.sample_at
        prefill = plan.kind == "prefill"
        slots = pending.packed.sample_slots()
        for i, row in enumerate(plan.rows):
            seq, work = row.seq, rows[i]
            if prefill or is_prompt_chunk(row):
                self.counters["prefill_tokens_computed"] += row.num_tokens
            seq.num_computed += row.num_tokens
            if work.tokens and is_placeholder(min(work.tokens)):  # any of them a placeholder
                # Its K/V hashes need that token's id: told to the block manager once it is known.
                computed.append(seq.num_computed)
            else:  # told now, so the next schedule sees it (a parent's fork copies these pages)
                self._mark_computed(seq, seq.token_view, seq.num_computed)
                computed.append(-1)
            preemptions.append(seq.num_preemptions)
            if work.samples:
                sample_at.append(len(seq.output_token_ids))
                seq.output_token_ids.append(placeholder(slots[i]))
            else:
                sample_at.append(-1)
        return step

    def _join_arrivals(self, plan: SchedulerOutput, in_flight: LaunchedStep) -> list[ScheduledRow]:
        """Hold `plan`'s dispatch back until just before the step in flight should end, for requests
        that arrive meanwhile (`arrivals`): their first prompt chunks join `plan` in the tokens it
        left, instead of waiting a step more. Returns the rows that joined. Not when nobody could
        join, the step's end is not known yet, or the step in flight has grammar rows (`plan`'s
        masks needed its tokens: it is done already)."""
        if self.arrivals is None or in_flight.constrained or not self.scheduler.takes_arrivals(plan):
            return []
        closes_at = self.arrival_window.closes_at(in_flight.pending.packed.shape[0], in_flight.dispatched_at)
        if closes_at is None or not self.arrivals(in_flight.pending, closes_at):
            return []
        return self.scheduler.top_up(plan)

    def _process(self, step: "LaunchedStep", start: float) -> list[RequestOutput]:
        """Take a dispatched step's samples (waiting for them if need be): each sampled token replaces
        its placeholder and is detokenized and checked for stops. Rows of sequences that finished or
        were aborted since the dispatch are dropped (a token computed past EOS is discarded)."""
        sampled = self._samples(step)
        scores = None
        if isinstance(sampled, tuple):
            sampled, scores = sampled
        advanced: dict[str, Request] = {}
        tokens = sampled.tokens.tolist()  # Python ints, one conversion for the step
        computed, preemptions, sample_at = step.computed, step.preemptions, step.sample_at
        for i, row in enumerate(step.plan.rows):
            seq = row.seq
            if seq.is_finished:
                continue
            if computed[i] >= 0 and seq.num_preemptions == preemptions[i]:  # still has those pages
                self._mark_computed(seq, seq.token_view, computed[i])
            targets = step.rows[i].targets
            if targets is not None:
                self.outputs.record_prompt_logprobs(seq, row.start, targets, scores, i)
            if sample_at[i] >= 0:
                if seq.params.logprobs is not None:
                    self.outputs.record_logprobs(seq, sampled, i)
                self._resolve_token(seq, sample_at[i], tokens[i])
                advanced[seq.request_id] = self.requests[seq.request_id]
        return self._finish_step(advanced, start)

    def _samples(self, step: "LaunchedStep"):
        if step.samples is None:
            step.samples = step.pending.result()
            self.arrival_window.done(step.pending.packed.shape[0], step.dispatched_at, time.perf_counter())
        return step.samples

    def _advance_grammars(self, step: "LaunchedStep") -> None:
        """Give each constrained row of a dispatched step its sampled token (waiting for the step), so
        that the next step's masks follow it; detokenizing and stop checks wait for `_process`."""
        sampled = self._samples(step)
        if isinstance(sampled, tuple):
            sampled = sampled[0]
        for i, row in enumerate(step.plan.rows):
            seq = row.seq
            if seq.grammar is not None and step.sample_at[i] >= 0 and not seq.is_finished:
                self.outputs.advance_grammar(seq, step.sample_at[i], int(sampled.tokens[i]))

    def _row_work(self, rows: list[ScheduledRow]) -> list[RowWork]:
        """Each row's share of the step; its page ids are the block manager's live table (with its
        version, so the runner rewrites a row's page table only when it changed)."""
        work = []
        live_page_ids = self.blocks.live_page_ids
        for r in rows:
            seq, start, n = r.seq, r.start, r.num_tokens
            view = seq.token_view
            # A decode row (most rows, every step): its one token by index, no slice of the view.
            tokens = [view[start]] if n == 1 else view[start : start + n]
            samples = r.samples
            pages, version = live_page_ids(seq.seq_id)
            work.append(RowWork(tokens, start, pages, self._row_sampling(seq), seq.replica,
                                self.outputs.prompt_targets(seq, start, n), samples,
                                seq.grammar if samples else None, step=len(seq.output_token_ids),
                                pages_version=version))
        return work

    @staticmethod
    def _row_sampling(seq: Sequence) -> RowSampling:
        """The sequence's sampling row, built once: its params and seed are fixed, and its prompt and
        output lists are read where they stand when a step is packed (the step index goes apart)."""
        if seq.row_sampling is None:
            seq.row_sampling = RowSampling.from_params(seq.params, seed=seq.seed, step=0,
                                                       prompt_ids=seq.prompt_token_ids, output_ids=seq.output_token_ids)
        return seq.row_sampling

    def _multi_step_lookahead(self, seq: Sequence, batch_size: int) -> int:
        """num_scheduler_steps: the decode steps after this one that `seq` may still take (the scheduler
        gives them pages); none past max_tokens or max_model_len, and none for a constrained row, whose
        next mask needs the token it samples now (it runs its one step inside the multi-step call)."""
        if seq.grammar is not None:
            return 0
        return max(0, min(self.settings.num_scheduler_steps - 1,
                          seq.params.max_tokens - len(seq.output_token_ids) - 1,
                          self.plan.max_model_len - seq.num_tokens - 1))

    def _multi_step(self, plan: SchedulerOutput, start: float) -> list[RequestOutput]:
        """Several decode steps in one call (num_scheduler_steps): each row emits up to 1 + its lookahead
        tokens; EOS, stop strings and max_tokens cut the run where they occur, as in single steps."""
        steps = [1 + r.num_lookahead for r in plan.rows]
        out = self.runner.execute_multi(self._row_work(plan.rows), steps)
        context = sum(r.start + 1 + r.num_lookahead for r in plan.rows)
        self.last_step_bytes_read = (max(steps) * self.plan.param_bytes
                                     + context * self.plan.kv_bytes_per_token)
        advanced: dict[str, Request] = {}
        for i, row in enumerate(plan.rows):
            seq = row.seq
            self._emit_run(seq, out.tokens[: steps[i], i].tolist(),
                           lambda j: self.outputs.record_logprobs(seq, jax.tree.map(lambda x: x[j], out), i))
            advanced[seq.request_id] = self.requests[seq.request_id]
        return self._finish_step(advanced, start)

    def _emit_run(self, seq: Sequence, emitted: list[int], record_logprobs) -> None:
        """Append the tokens one call produced for `seq` (a verified speculation, or several decode
        steps): the pending token and every emitted one but the last were the call's inputs, so their
        K/V is written. EOS, stop strings and max_tokens cut the run where they occur.
        `record_logprobs(j)` records the logprobs of emitted[j] (called only when they are asked for)."""
        seq.num_computed += len(emitted)
        self._mark_computed(seq, seq.tokens + emitted[:-1], seq.num_computed)
        for j, token in enumerate(emitted):
            if seq.params.logprobs is not None:
                record_logprobs(j)
            self._append_token(seq, token)
            if seq.is_finished:
                break

    def _finish_step(self, advanced: dict[str, Request], start: float) -> list[RequestOutput]:
        outputs = []
        for request in advanced.values():
            delta = self._output(request)
            if delta is not None:
                outputs.append(delta)
            if request.finished:
                del self.requests[request.request_id]
        self.counters["steps"] += 1
        self.last_step_seconds = time.perf_counter() - start
        if self.spec is not None:  # measured step times steer how much to speculate
            self.spec.record_step_time(self.last_step_seconds)
        return outputs

    def _mark_computed(self, seq: Sequence, tokens: TokenView | list[int], num_computed: int) -> None:
        """Tell the block manager that the first `num_computed` tokens are computed. With a draft
        model, only tokens whose draft K/V is written too (the draft may lag by a token or more), so
        a prefix-cache hit serves both caches."""
        lag = seq.spec.lag if seq.spec is not None else 0
        self.blocks.mark_computed(seq.seq_id, tokens, num_computed - lag)

    def _speculative_step(self, plan: SchedulerOutput, start: float) -> list[RequestOutput]:
        """One speculative ragged step: prompt chunks advance as in a plain step; each decode row emits
        its accepted drafts and the target's next token (EOS, stop strings and max_tokens cut the run
        where they occur). A step scoring prompt tokens (prompt_logprobs) verifies nothing: it runs the
        scoring variant, a plain step."""
        rows = self._row_work(plan.rows)
        if any(r.targets is not None for r in rows):
            for row in plan.rows:
                row.num_lookahead = 0
            return self._process(self._launch(plan, rows=rows), start)
        self.composition.record(plan.rows)
        self.spec.prepare(plan.rows, rows)
        out = self.runner.execute(rows)
        self.spec.record(plan.rows, out.num_accepted)  # before marking: the draft's lag bounds what is computed
        context = sum(r.start + r.num_tokens + r.num_lookahead for r in plan.rows)
        self.last_step_bytes_read = self.plan.param_bytes + context * self.plan.kv_bytes_per_token
        advanced: dict[str, Request] = {}
        for i, row in enumerate(plan.rows):
            seq = row.seq
            samples = SampleOutput(out.tokens[i], out.logprobs[i], out.top_ids[i], out.top_logprobs[i])
            if is_prompt_chunk(row):
                self.counters["prefill_tokens_computed"] += row.num_tokens
                seq.num_computed += row.num_tokens
                self._mark_computed(seq, seq.token_view, seq.num_computed)
                if not row.samples:
                    continue
                if seq.params.logprobs is not None:
                    self.outputs.record_logprobs(seq, samples, 0)
                self._append_token(seq, int(out.tokens[i, 0]))
            else:
                self._emit_run(seq, out.tokens[i, : int(out.num_accepted[i]) + 1].tolist(),
                               lambda j: self.outputs.record_logprobs(seq, samples, j))
            advanced[seq.request_id] = self.requests[seq.request_id]
        return self._finish_step(advanced, start)

    def _copy_forked_pages(self, plan: SchedulerOutput) -> None:
        for replica in {c[0] for c in plan.page_copies}:
            pairs = np.asarray([(s, d) for r, s, d in plan.page_copies if r == replica], np.int32)
            self.runner.copy_pages(replica, pairs[:, 0], pairs[:, 1])  # the draft's cache too

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.output_token_ids.append(token)
        self._resolve_token(seq, len(seq.output_token_ids) - 1, token)

    def _resolve_token(self, seq: Sequence, index: int, token: int) -> None:
        """`token` is output `index` of `seq`: the output processor takes it; a sequence that stops
        here leaves the batch and frees its pages at once."""
        self.counters["generation_tokens"] += 1
        reason = self.outputs.resolve_token(seq, index, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _output(self, request: Request) -> RequestOutput | None:
        return self.outputs.delta(request, self._spec_metrics(request.seqs))

    def _spec_metrics(self, seqs: list[Sequence]) -> dict:
        if self.spec is None:
            return {}
        states = [s.spec for s in seqs if s.spec is not None]
        return dict(spec_draft_tokens=sum(st.proposed for st in states),
                    spec_accepted_tokens=sum(st.accepted for st in states),
                    spec_verify_steps=sum(st.verify_steps for st in states))

    # ---- observability -------------------------------------------------------------------------
    def stats(self) -> dict:
        s, b = self.scheduler, self.blocks
        replicas = range(self.num_replicas)
        queried = b.num_prefix_queried_tokens
        return dict(
            num_running=len(s.running),
            num_running_per_replica=[sum(q.replica == r for q in s.running) for r in replicas],
            num_waiting=len(s.waiting),
            num_preemptions=s.num_preemptions,
            pages_used=[b.num_used_pages(r) for r in replicas],
            pages_free=[b.num_free_pages(r) for r in replicas],
            kv_cache_utilization=[b.kv_utilization(r) for r in replicas],
            prefix_cache_hit_rate=(b.num_prefix_hit_tokens / queried) if queried else 0.0,
            compiles_after_warmup=(CompileCounter.requests - self.compiles_at_warm_up)
            if self.compiles_at_warm_up is not None else None,
            executables=self.num_executables(),
            prompt_tokens_total=self.counters["prompt_tokens"],
            generation_tokens_total=self.counters["generation_tokens"],
            prefill_tokens_computed=self.counters["prefill_tokens_computed"],
            arrivals_joined_total=self.counters["arrivals_joined"],
            last_step_seconds=self.last_step_seconds,
            last_step_bytes_read=self.last_step_bytes_read,
            # structured output: host time computing grammar masks, and the constrained rows masked
            grammar_mask_seconds_total=self.runner.mask_seconds,
            grammar_masked_rows_total=self.runner.masked_rows,
            **self.composition.as_stats(),
            **(self.spec.stats() if self.spec is not None else {}),
            **(self.multihost.stats() if self.multihost is not None else {}),
        )


class AsyncLLMEngine:
    """Runs LLMEngine.step in one background thread and hands each request's deltas to its caller's
    asyncio queue.

    The event loop never waits for a step: `submit` checks a request synchronously (so a bad one
    still raises RequestError, the server's 400) and hands it to the step thread through the intake
    queue, which the thread drains between steps, as it does aborts. Each step's deltas go straight
    into the queue the caller gave (the server gives one per HTTP request, shared by its prompts).
    Only the step thread touches the engine's scheduler state; `stats()` takes the step lock and is
    for a worker thread."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()  # held by the step thread for a step and its intake; by stats()/shutdown()
        # Set while a stats() caller waits for the lock: the step thread, which would take it straight
        # back after each step, gives it up for a moment (Python's lock is not fair).
        self._stats_waiting = threading.Event()
        self._intake: collections.deque = collections.deque()  # ("add", id, ids, params, grammar) | ("abort", id)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # request id -> where its deltas go: (the caller's event loop, its queue, the caller's tag)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Any]] = {}
        self._ids = itertools.count()
        engine.arrivals = self._admit_arrivals
        # Steps in flight whose end wakes the step thread (held back for arrivals, it waits on _wake).
        self._watched: queue.SimpleQueue = queue.SimpleQueue()
        self._watcher: threading.Thread | None = None

    @classmethod
    def from_settings(cls, settings: EngineConfig) -> "AsyncLLMEngine":
        return cls(LLMEngine(settings))

    # ---- what the server reads (jaxserve.server.engine_protocol.ServingEngine) ----------------
    @property
    def tokenizer(self):
        """The model's `Tokenizer`, or None (prompts as token ids only)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.plan.max_model_len

    @property
    def settings(self) -> EngineConfig:
        return self.engine.settings

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the step thread, then close the engine (its executables, weights and cache released);
        if the thread is still in a step after `timeout`, the engine is left open."""
        self._stop.set()
        self._wake.set()
        self._watched.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %s s; the engine is left open", timeout)
                return
            self._thread = None
        with self._lock:
            self.engine.close()

    def _drain_intake(self) -> None:
        """Admit the requests and aborts that arrived since the last step (step thread, under the lock)."""
        while self._intake:
            kind, request_id, *rest = self._intake.popleft()
            if kind == "abort":
                last = self.engine.abort_request(request_id)
                if last is not None:
                    self._deliver(request_id, last)
            else:
                self._add(request_id, *rest)

    def _admit_arrivals(self, in_flight: PendingSamples, until: float) -> int:
        """LLMEngine.arrivals (step thread, under the lock): wait for new requests until `until`
        (time.perf_counter) or until the step `in_flight` is done, and add those at the head of the
        intake; returns how many were added. An abort stops the taking, and waits for the next
        drain: a row of the step being held back may be the aborted request's, and its pages must
        stay its own until then."""
        self._watch(in_flight)
        while True:
            self._wake.clear()  # before looking: whatever arrives later sets it and ends the wait below
            added = 0
            while self._intake and self._intake[0][0] == "add":
                _, request_id, *rest = self._intake.popleft()
                added += self._add(request_id, *rest)
            if added or self._stop.is_set() or in_flight.is_ready():
                return added
            left = until - time.perf_counter()
            if left <= 0:
                return 0
            self._wake.wait(left)  # set by an arrival, by the watcher when the step ends, or by shutdown

    def _watch(self, pending: PendingSamples) -> None:
        """Have the watcher thread set _wake once `pending`'s step is done (no polling: a wake-up a
        millisecond would take CPU from the step's own threads on a small host)."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_steps, name="jaxserve-step-watcher", daemon=True)
            self._watcher.start()
        self._watched.put(pending)

    def _watch_steps(self) -> None:
        while (pending := self._watched.get()) is not None:
            try:
                pending.wait()
            except Exception:  # noqa: BLE001 - a failed step fails in the step thread; here it only wakes it
                pass
            self._wake.set()

    def _add(self, request_id: str, ids: list[int], params: SamplingParams, grammar: Any) -> bool:
        """Add one request from the intake; a late refusal fails that request only."""
        try:
            if grammar is None:
                self.engine.add_request(request_id, None, params, ids)
            else:
                self.engine.add_request(request_id, None, params, ids, grammar=grammar)
            return True
        except Exception as err:  # noqa: BLE001 - checked at intake; a late refusal fails this request only
            self._deliver(request_id, err if isinstance(err, RequestError) else RequestError(str(err)))
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before draining: whatever arrives later sets it again and ends the wait below
            with self._lock:
                self._drain_intake()
                busy = self.engine.has_unfinished_requests()
                if busy:
                    try:
                        outputs = self.engine.step()
                    except Exception as err:  # a failed step fails its requests, never the loop
                        logger.exception("engine step failed")
                        self._fail_all(err)
                        continue
            if not busy:
                self._wake.wait(0.05)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
            if self._stats_waiting.is_set():
                time.sleep(0.0005)  # let the stats() caller blocked on the lock take it

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        """Put `(tag, item)` in the request's queue; its last item (finished, or an error) ends its stream."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        loop, queue, tag = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (tag, item))
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass

    def _fail_all(self, err: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            self._deliver(request_id, err)

    async def submit(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None,
                     queue: asyncio.Queue, tag: Any = None) -> None:
        """Check the request and queue it for the step thread. A bad request raises RequestError here
        (GrammarError for a schema the grammar library rejects), before it enters the engine. From
        then on `queue` receives `(tag, delta)` each step the request advances (a RequestOutput of
        what is new; the last one has `finished`), or `(tag, exception)` if the request fails.
        Several requests may share a queue; `abort` stops one."""
        ids, params = self.engine.prepare_request(None, sampling_params, prompt_token_ids)  # no step state
        grammar = None
        if params.structured is not None:  # compiled on the compiler's thread; GrammarError is the 400
            # Shielded: a caller that goes away must not cancel a compilation other requests share.
            compiling = self.engine.grammar_compiler.submit(params.structured)
            grammar = await asyncio.shield(asyncio.wrap_future(compiling))
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = (asyncio.get_running_loop(), queue, tag)
        self._intake.append(("add", request_id, ids, params, grammar))
        self.start()
        self._wake.set()

    async def generate(
        self,
        request_id: str | None = None,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's delta each time it advances (sum them with OutputAccumulator for whole
        outputs); aborts the request if the caller stops early."""
        request_id = request_id or f"req-{next(self._ids)}"
        ids, params = self.engine.prepare_request(prompt, sampling_params, prompt_token_ids)
        async for delta in stream_deltas(self, request_id, ids, params):
            yield delta

    def abort(self, request_id: str) -> None:
        """Abort between steps (queued behind the request's own admission, so it cannot overtake it);
        any thread may call it. Its queue gets a last delta with finish_reason 'abort'."""
        self._intake.append(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        self._stats_waiting.set()
        with self._lock:
            self._stats_waiting.clear()
            return self.engine.stats()
