"""EngineCore: continuous batching over the paged KV cache, host only (no jax in its imports).

A deterministic state machine: no threads, no waits but reading a step's samples. One step is
three calls:

    batch = self.schedule()                  # which rows run, and how many tokens each
    step = self.execute(batch)               # the runner prepares and dispatches it (not waited for)
    return self.update_from_output(step)     # the samples: tokens appended, stops checked, deltas out

Async scheduling is a queue of in-flight steps around the same calls, kept by `engine.overlap.Overlap`
(with the hold-back for arrivals and the grammars' wait): step N+1 is scheduled and dispatched
before step N's samples are processed (its inputs name N's samples as placeholders, resolved on the
device), so the host's work on step N overlaps the device's on step N+1. Multi-step decoding and
speculation are variants of `execute` (the scheduler gave the rows their extra decode steps or their
drafts) and of `update_from_output` (a row emits a run of tokens, not one).

The central invariant: a sequence's `num_computed` tokens have their K/V in its pages, and every
token it holds past them is either a placeholder of a step in flight or the one it feeds next.

`LLMEngine` (jaxserve.llm_engine) builds the device half (the runner: params, KV cache,
executables) and this core over it; `AsyncLLMEngine` runs its steps through `Overlap` on a thread of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.in_flight import DispatchedRow, InFlightStep
from jaxserve.engine.intake import Abort, Intake
from jaxserve.engine.output_processor import OutputProcessor, Request
from jaxserve.engine.processor import EngineRequest, Limits, Processor, check_open, claim
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.scheduler_output import ScheduledRow, SchedulerOutput
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.stats import engine_stats, spec_metrics
from jaxserve.engine.step_stats import StepComposition, is_prompt_chunk
from jaxserve.errors import RequestError
from jaxserve.kv_transfer.driver import build_driver
from jaxserve.model.ragged import placeholder
from jaxserve.sampling.params import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestFailure:
    """A request refused after it was queued (a late check), as a step's output: its stream ends with
    `error`."""

    request_id: str
    error: Exception


class EngineCore:
    """Requests in, deltas out; not thread-safe (AsyncLLMEngine serialises calls). `runner` is the
    device half (`jaxserve.runner.runner.ModelRunner`); `memory` the KV cache's MemoryPlan;
    `speculation` makes the SpeculativeDecoder (`jaxserve.spec_decode`) once the block manager exists:
    the scheduler is built with its drafts as its lookahead."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Any,
        *,
        model_config: ModelConfig,
        memory: Any,
        tokenizer: Any = None,
        speculation: Callable[[], Any] | None = None,
    ):
        self.config = s = config
        self.runner = runner
        self.model_config = cfg = model_config
        self.memory = memory
        self.tokenizer = tokenizer
        self.buckets = runner.buckets
        self.num_replicas = runner.num_replicas
        eos = tokenizer.eos_token_ids if tokenizer is not None and tokenizer.eos_token_ids else cfg.eos_token_ids
        self.outputs = OutputProcessor(tokenizer, eos, memory.max_model_len)
        # Every layer windowed (Mistral): pages wholly behind the window go back to the pool. Not with a
        # draft model, whose cache shares the page ids and need not be windowed.
        windowed = cfg.sliding_window and cfg.num_sliding_layers == cfg.num_layers and s.speculation != "draft"
        self.blocks = BlockManager(
            memory.num_pages,
            s.page_size,
            self.num_replicas,
            enable_prefix_caching=s.enable_prefix_caching,
            sliding_window=cfg.sliding_window if windowed else None,
        )
        self.spec: Any = speculation() if speculation is not None else None  # the SpeculativeDecoder
        lookahead, later_steps = None, False
        if self.spec is not None:  # drafts to verify, in the step's token budget
            lookahead = self.spec.lookahead
        elif s.num_scheduler_steps > 1:  # pages for the extra decode steps, where free ones exist
            # A step of decodes alone runs them num_scheduler_steps in one call; a step holding a
            # prompt chunk is one plain mixed ragged step, as in every engine.
            lookahead, later_steps = self._multi_step_lookahead, True
        self.scheduler = Scheduler(
            self.blocks,
            s.max_num_seqs,
            s.max_num_batched_tokens,
            memory.max_model_len,
            scheduling=s.scheduling,
            preemption_mode=s.preemption_mode,
            lookahead=lookahead,
            lookahead_steps=later_steps,
        )
        # A KV connector (jaxserve.kv_transfer: the host tier, or one moving pages between engines).
        self.scheduler.kv = build_driver(s, self.scheduler, runner)
        if s.async_scheduling and not self.can_overlap:
            logger.info("async scheduling off: multi-step engines run each step to completion first")
        self.intake = Intake()
        self.requests: dict[str, Request] = {}
        self._outbox: list = []  # aborted requests' last deltas and late refusals, out with the next outputs
        self._grammar_compiler = None  # structured output: made on the first constrained request
        self._grammar_lock = threading.Lock()
        self._seed_stream = np.random.default_rng(s.seed)
        self.counters = dict(
            prompt_tokens=0, generation_tokens=0, prefill_tokens_computed=0, steps=0, arrivals_joined=0
        )
        self.composition = StepComposition(self.buckets.token_counts, memory.param_bytes, memory.kv_bytes_per_token)
        self.last_step_seconds = 0.0
        self._step_started = 0.0  # time.perf_counter() of the last schedule()
        self.multihost: Any = None  # multi-host process 0: the runner's peers (multihost.Leader)
        self.lora: Any = None  # LoRA serving: the engine.lora_manager.LoRAManager, once enable_lora
        self.closed = False

    def enable_lora(self, manager: Any) -> None:
        """Serve LoRA adapters (`engine.lora_manager.LoRAManager`): at most `max_loras` run at once."""
        self.lora = manager
        self.scheduler.max_loras = manager.max_loras

    @property
    def limits(self) -> Limits:
        refusal = None
        if self.config.speculation:
            # Verification would need the grammar's masks at every drafted position (and a rollback
            # of rejected drafts); until the speculative step takes them, the two are exclusive.
            refusal = (
                "structured output is not supported with speculative decoding "
                f"(speculation={self.config.speculation!r}); start the engine without it"
            )
        elif self.tokenizer is None:
            refusal = "structured output needs the model's tokenizer (start with tokenizer=PATH)"
        return Limits(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.memory.max_model_len,
            page_size=self.blocks.page_size,
            usable_pages=self.memory.num_pages - 1 - self.blocks.watermark_pages,
            max_num_seqs=self.config.max_num_seqs,
            sliding_window=self.blocks.sliding_window,
            structured_refusal=refusal,
            prompt_logprobs=self.config.enable_prompt_logprobs,
            max_logprobs=self.config.max_logprobs,
        )

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
        self.closed = True
        self.intake.close()
        if self.multihost is not None:  # process 0: the other processes stop their follower loops
            self.multihost.shutdown()
        if self.spec is not None:
            self.spec.close()
        if self.scheduler.kv is not None:
            self.scheduler.kv.close()
        self.runner.close()
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()

    def _check_open(self) -> None:
        check_open(self.closed)

    # ---- requests ------------------------------------------------------------------------------
    @functools.cached_property
    def processor(self) -> Processor:
        """The one way in (`engine.processor`): prompts to checked EngineRequests, their grammars
        compiling on the compiler's thread. Reads only fixed things: any thread may call it."""
        return Processor(self.limits, self.tokenizer, grammars=lambda spec: self.grammar_compiler.submit(spec))

    @property
    def grammar_compiler(self):
        """The structured-output GrammarCompiler (jaxserve.structured) for this model's tokenizer and
        logits width: compiles on its own thread, caches by spec. Any thread may use it."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise RequestError("structured output needs the model's tokenizer (start with tokenizer=PATH)")
                from jaxserve.structured.compiler import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer, vocab_size=self.model_config.vocab_size)
            return self._grammar_compiler

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        grammar=None,
        lora_request: Any = None,
    ) -> None:
        """Check (`processor.process`) and queue a request (with `lora_request`, a `LoRARequest`, under
        that adapter). `grammar`: its CompiledGrammar when the caller compiled `structured` already;
        otherwise it is compiled (cached by spec), and a spec the grammar library rejects raises GrammarError."""
        self._check_open()
        self.admit(
            self.processor.process(
                request_id, prompt, sampling_params, prompt_token_ids, lora_request=lora_request, grammar=grammar
            )
        )

    def admit(self, request: EngineRequest) -> None:
        """Queue a request the processor made (checked there); here only what depends on the engine now."""
        request_id, ids, params = request.request_id, request.prompt_token_ids, request.params
        claim(request_id, self.requests, self.closed)
        adapter = None if request.lora_request is None else self.resolve_lora(request.lora_request)
        grammar = request.grammar
        if params.structured is not None:
            if grammar is None:
                grammar = self.grammar_compiler.compile(params.structured)
            elif isinstance(grammar, Future):  # compiling on the compiler's thread
                grammar = grammar.result()
        base_seed = params.seed if params.seed is not None else int(self._seed_stream.integers(2**32))
        seqs = [
            Sequence(
                seq_id=f"{request_id}#{i}",
                request_id=request_id,
                index=i,
                prompt_token_ids=ids,
                params=params,
                seed=(base_seed + 0x9E3779B9 * i) % 2**32,
                detokenizer=self.outputs.detokenizer(ids, params),
                lora=adapter,
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
        self.requests[request_id] = Request(request_id, request.prompt, ids, params, seqs, request.arrival_time)
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

    def take_intake(self) -> list[RequestOutput | RequestFailure]:
        """Admit the requests and carry out the aborts queued by other threads (`intake`); returns
        the aborted requests' last deltas and the late refusals."""
        for item in self.intake.take_all():
            if isinstance(item, Abort):
                last = self.abort_request(item.request_id)
                if last is not None:
                    self._outbox.append(last)
            else:
                self._admit_queued(item)
        return self.take_outbox()

    def _admit_queued(self, request: EngineRequest) -> bool:
        try:
            self.admit(request)
            return True
        except Exception as err:  # noqa: BLE001 - checked at intake; a late refusal fails this request only
            self._outbox.append(
                RequestFailure(request.request_id, err if isinstance(err, RequestError) else RequestError(str(err)))
            )
            return False

    def has_unfinished_requests(self) -> bool:
        """Requests not finished (the core keeps no step in flight: `Overlap` does)."""
        return bool(self.requests)

    def has_kv_transfers(self) -> bool:
        """A KV connector holds finished sequences' pages until saved (a prefill engine's, until pulled or
        expired): steps must go on polling it even with no request left (AsyncLLMEngine does, slowly)."""
        return self.scheduler.kv is not None and bool(self.scheduler.kv.saving)

    def only_waiting_for_kv(self) -> bool:
        """Every unfinished request waits for a KV connector's load: a step has nothing to run, so the
        step thread should poll, not spin (a spin starves the threads moving those pages)."""
        s = self.scheduler
        return s.kv is not None and bool(s.kv.loading) and not s.running and not s.waiting

    def admit_arrivals(self) -> int:
        """Admit the requests at the head of the intake, up to its first abort (which waits for
        `take_intake`: the step being held back may hold that request's row); returns how many were
        admitted. The overlap wrapper's hold-back for arrivals calls it."""
        return sum(self._admit_queued(item) for item in self.intake.take_arrivals())

    def take_outbox(self) -> list:
        """The aborted requests' last deltas and late refusals not yet returned."""
        out, self._outbox = self._outbox, []
        return out

    @property
    def can_overlap(self) -> bool:
        """Whether a step may be dispatched before the one before it is processed (async scheduling):
        not with multi-step, whose run lengths decide the next inputs on the host. With speculation,
        only steps that verify nothing overlap (`needs_host_tokens`, `InFlightStep.serial`)."""
        return self.config.num_scheduler_steps == 1

    def needs_host_tokens(self) -> bool:
        """Whether the next step, not scheduled yet, may need the tokens of the step in flight on the
        host: a speculative step that drafts (`SpeculativeDecoder.may_draft`)."""
        return self.spec is not None and self.spec.may_draft(self.scheduler.running)

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute and process one step, and return a delta for each request that advanced:
        a RequestOutput holding only what is new (token ids, text, logprob entries, finish reason;
        sum them with output_processor.OutputAccumulator). Serial: the overlap of async scheduling
        is `engine.overlap.Overlap`, around the same three calls."""
        step = self.execute(self.schedule())
        outputs = self.update_from_output(step) if step is not None else []
        return outputs + self.take_outbox()

    def schedule(self) -> SchedulerOutput:
        """Which rows run next and how many tokens each (the scheduler's decision, drafts and
        multi-step's later steps included)."""
        self._check_open()
        self._step_started = time.perf_counter()
        if self.scheduler.kv is not None:  # loads and saves finished since: those sequences move on
            self.scheduler.kv.poll()
        return self.scheduler.schedule()

    def execute(self, batch: SchedulerOutput) -> InFlightStep | None:
        """Hand the batch's update to the runner (page copies of forked sequences first) and dispatch
        it, not waiting for it; None if it has no rows. A plain step's sampling rows get a placeholder
        for their token and their tokens count as computed, so the next step can be scheduled at once.
        A constrained row's grammar must have taken its previous token (`advance_grammars`). A KV
        connector's saves and loads go first (a save reads a page this step may overwrite)."""
        if self.scheduler.kv is not None:
            self.scheduler.kv.start()
        self._copy_forked_pages(batch)
        if not batch.rows:
            return None
        if self.lora is not None:  # every running sequence's adapter in a device slot (at most max_loras)
            self.lora.prepare(self.scheduler.adapters_in_use(waiting=False))
        verifies, calls = False, 1  # calls: decode steps in the call (multi-step), each reading every weight
        if self.spec is not None:  # drafts: a step verifying none is a plain step (placeholders, overlap)
            verifies = self.spec.dispatch(batch.rows, batch.update.rows)
        elif self.config.num_scheduler_steps > 1:  # a step of decodes alone: its rows' later steps in one call
            calls = 1 + max(row.num_lookahead for row in batch.rows)
        serial = verifies or calls > 1
        self.composition.record(batch.rows, calls)  # before the rows take placeholders
        constrained = self.samples_under_grammar(batch)
        pending = self.runner.execute(batch.update)  # applied, laid out, dispatched, not waited for
        dispatched_at = time.perf_counter()
        rows = self._dispatched_rows(batch, pending, serial)
        return InFlightStep(batch, rows, pending, serial, verifies, constrained, dispatched_at)

    def _dispatched_rows(self, batch: SchedulerOutput, pending: Any, serial: bool) -> list[DispatchedRow]:
        """Each row's record of what its update owes it. A plain step's bookkeeping is done here, at
        dispatch: each row's tokens count as computed, and each row that samples holds a placeholder
        of its token until the step is processed (a serial step's rows append their runs then)."""
        targets = self.outputs.prompt_targets
        if serial:
            return [DispatchedRow(row, targets(row.seq, row.start, row.num_tokens)) for row in batch.rows]
        records = []
        prefill, prefill_tokens = batch.kind == "prefill", 0
        for row, slot in zip(batch.rows, pending.packed.sample_slots()):
            seq = row.seq
            record = DispatchedRow(row, targets(seq, row.start, row.num_tokens), preemptions=seq.num_preemptions)
            if prefill or row.start < seq.num_tokens - 1:  # a prompt chunk (step_stats.is_prompt_chunk)
                prefill_tokens += row.num_tokens
            samples = row.samples
            seq.num_computed += row.num_tokens
            if samples and seq.in_flight:  # its input is the token still in flight: a placeholder
                # Its K/V hashes need that token's id: told to the block manager once it is known.
                record.computed = seq.num_computed
            else:  # told now, so the next schedule sees it (a parent's fork copies these pages)
                self._mark_computed(seq, seq.token_view, seq.num_computed)
            if samples:
                record.sample_at = len(seq.output_token_ids)
                seq.output_token_ids.append(placeholder(slot))
            records.append(record)
        self.counters["prefill_tokens_computed"] += prefill_tokens
        return records

    @staticmethod
    def samples_under_grammar(batch: SchedulerOutput) -> bool:
        """Whether a row of `batch` samples under a grammar: its mask needs every token before it."""
        return any(row.samples and row.seq.grammar is not None for row in batch.rows)

    def advance_grammars(self, step: InFlightStep, samples: Any) -> None:
        """Give each constrained row of a dispatched step its sampled token (`samples`: the step's
        StepSamples), so that the next step's masks follow it; detokenizing and stop checks wait for
        its update."""
        tokens = samples.tokens
        for i, record in enumerate(step.rows):
            seq = record.row.seq
            if seq.grammar is not None and record.sample_at is not None and not seq.is_finished:
                self.outputs.advance_grammar(seq, record.sample_at, int(tokens[i, 0]))

    def update_from_output(self, step: InFlightStep) -> list[RequestOutput]:
        """Take a dispatched step's samples (waiting for them if need be): each row's run of tokens
        is appended (a plain step's one token replaces its placeholder), detokenized and checked for
        stops, which cut a run where they occur. Rows of sequences that finished or were aborted
        since the dispatch are dropped (a token computed past EOS is discarded)."""
        samples = step.samples()
        if step.verifies:  # before marking: the draft's lag bounds what is computed
            self.spec.record(step.batch.rows, np.maximum(samples.num_emitted - 1, 0))
        advanced: dict[str, Request] = {}
        tokens = samples.tokens.tolist()  # Python ints, one conversion for the step
        emitted = samples.num_emitted.tolist()
        requests, outputs, serial = self.requests, self.outputs, step.serial
        for i, record in enumerate(step.rows):
            row = record.row
            seq = row.seq
            if seq.is_finished:
                continue
            if record.targets is not None:
                outputs.record_prompt_logprobs(seq, row.start, record.targets, samples.scores, i)
            if serial:
                self._emit_run(seq, row, tokens[i][: emitted[i]], samples, i)
            else:
                if record.computed is not None and seq.num_preemptions == record.preemptions:  # still has those pages
                    self._mark_computed(seq, seq.token_view, record.computed)
                if record.sample_at is not None:
                    if seq.params.logprobs is not None:
                        outputs.record_logprobs(seq, samples.row(i), 0)
                    self._resolve_token(seq, record.sample_at, tokens[i][0])
            if emitted[i]:
                advanced[seq.request_id] = requests[seq.request_id]
        return self._finish_step(advanced)

    def _emit_run(self, seq: Sequence, row: ScheduledRow, run: list[int], samples: Any, i: int) -> None:
        """A serial step's row: its input tokens and every emitted token but the last were the call's
        inputs, so their K/V is written; then the run is appended up to where it stops."""
        if is_prompt_chunk(row):
            self.counters["prefill_tokens_computed"] += row.num_tokens
        seq.num_computed += row.num_tokens + max(len(run) - 1, 0)
        self._mark_computed(seq, seq.token_view if len(run) <= 1 else seq.tokens + run[:-1], seq.num_computed)
        for j, token in enumerate(run):
            if seq.params.logprobs is not None:
                self.outputs.record_logprobs(seq, samples.row(i), j)
            seq.output_token_ids.append(token)
            self._resolve_token(seq, len(seq.output_token_ids) - 1, token)
            if seq.is_finished:
                break

    def _multi_step_lookahead(self, seq: Sequence, batch_size: int) -> int:
        """num_scheduler_steps: the decode steps after this one that `seq` may still take (the scheduler
        gives them pages); none past max_tokens or max_model_len, and none for a constrained row, whose
        next mask needs the token it samples now (it runs its one step inside the multi-step call)."""
        if seq.grammar is not None:
            return 0
        return max(
            0,
            min(
                self.config.num_scheduler_steps - 1,
                seq.params.max_tokens - len(seq.output_token_ids) - 1,
                self.memory.max_model_len - seq.num_tokens - 1,
            ),
        )

    def _finish_step(self, advanced: dict[str, Request]) -> list[RequestOutput]:
        """The delta of each request that advanced (a finished one leaves the engine); the step's
        time, from its schedule (with async scheduling, the next step's) to here."""
        outputs, delta, requests = [], self.outputs.delta, self.requests
        for request in advanced.values():
            out = delta(request, spec_metrics(self.spec, request.seqs)) if self.spec is not None else delta(request)
            if out is not None:
                outputs.append(out)
            if request.finished:
                del requests[request.request_id]
        self.counters["steps"] += 1
        self.last_step_seconds = time.perf_counter() - self._step_started
        if self.spec is not None:  # measured step times steer how much to speculate
            self.spec.record_step_time(self.last_step_seconds)
        return outputs

    def _mark_computed(self, seq: Sequence, tokens: Any, num_computed: int) -> None:
        """Tell the block manager that the first `num_computed` tokens are computed. With a draft
        model, only tokens whose draft K/V is written too (the draft may lag by a token or more), so
        a prefix-cache hit serves both caches."""
        lag = seq.spec.lag if seq.spec is not None else 0
        self.blocks.mark_computed(seq.seq_id, tokens, num_computed - lag)

    def _copy_forked_pages(self, batch: SchedulerOutput) -> None:
        for replica in {c[0] for c in batch.page_copies}:
            pairs = np.asarray([(s, d) for r, s, d in batch.page_copies if r == replica], np.int32)
            self.runner.copy_pages(replica, pairs[:, 0], pairs[:, 1])  # the draft's cache too

    def _resolve_token(self, seq: Sequence, index: int, token: int) -> None:
        """`token` is output `index` of `seq`: the output processor takes it; a sequence that stops
        here leaves the batch and frees its pages at once."""
        self.counters["generation_tokens"] += 1
        reason = self.outputs.resolve_token(seq, index, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _output(self, request: Request) -> RequestOutput | None:
        return self.outputs.delta(request, spec_metrics(self.spec, request.seqs))

    # ---- observability -------------------------------------------------------------------------
    def stats(self) -> dict:
        """The engine's gauges and counters (`engine.stats.engine_stats`: what /metrics shows)."""
        return engine_stats(self)

    # ---- LoRA adapters (engine.lora_manager) ---------------------------------------------------
    def _lora_manager(self) -> Any:
        if self.lora is None:
            raise RequestError("LoRA adapters are not enabled: start the engine with enable_lora=True (--enable-lora)")
        return self.lora

    def resolve_lora(self, lora_request: Any) -> Any:
        """The adapter a request names, its weights read (a new LoRARequest offline registers itself)."""
        return self._lora_manager().resolve(lora_request)

    def add_lora(self, lora_request: Any, weights: Any = None) -> None:
        """Register an adapter (its PEFT weights read now unless given); LoRAError if it cannot be."""
        self._lora_manager().add(lora_request, weights)

    def remove_lora(self, name: str) -> None:
        """Unregister an adapter: new requests cannot name it; running ones finish with it."""
        self._lora_manager().remove(name)

    def list_loras(self) -> list:
        """The registered adapters' LoRARequests (any thread may call it)."""
        return [] if self.lora is None else list(self.lora.snapshot)
