"""AsyncLLMEngine: the engine core's steps, overlapped (`engine.overlap`), on a background thread,
each request's progress streamed to its caller's asyncio queue.

The event loop never waits for a step: `submit` takes a request the core's processor checked (a bad
one raised RequestError there, the server's 400) and puts it in the core's intake, which the step thread
takes between steps (and while it holds a step back for arrivals), as it does aborts. Each step's
deltas go straight into the queue the caller gave (the server gives one per HTTP request, shared by
its prompts). Only the step thread touches the core; `stats()` takes the step lock and is for a
worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, AsyncIterator

from jaxserve.config import EngineConfig
from jaxserve.engine.core import EngineCore, RequestFailure
from jaxserve.engine.intake import Abort
from jaxserve.engine.output_processor import stream_deltas
from jaxserve.engine.overlap import Overlap
from jaxserve.engine.pause import abort_all, check_mode
from jaxserve.engine.processor import EngineRequest, Processor, claim
from jaxserve.errors import LoRAError
from jaxserve.sampling.params import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    def __init__(self, engine: EngineCore):
        self.engine = engine
        # The step loop: the core's steps overlapped, held back for requests arriving meanwhile.
        self.overlap = Overlap(engine, arrivals=True)
        self._lock = threading.Lock()  # held by the step thread for a step and its intake; by stats()/shutdown()
        # Set while a stats() caller waits for the lock: the step thread, which would take it straight
        # back after each step, gives it up for a moment (Python's lock is not fair).
        self._stats_waiting = threading.Event()
        self._thread: threading.Thread | None = None
        # request id -> where its deltas go: (the caller's event loop, its queue, the caller's tag)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Any]] = {}
        self._ids = itertools.count()
        self._draining = False  # pause("wait"): the step thread takes no new request

    # ---- what the server reads (jaxserve.server.engine_protocol.ServingEngine) ----------------
    @property
    def tokenizer(self):
        """The model's `Tokenizer`, or None (prompts as token ids only)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.memory.max_model_len

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
            self._thread.start()

    def is_alive(self) -> bool:
        """False once the step thread has stopped after starting (a health check's question)."""
        return self._thread is None or self._thread.is_alive()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the step thread, then close the engine (its executables, weights and cache released);
        if the thread is still in a step after `timeout`, the engine is left open."""
        self.engine.intake.close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %s s; the engine is left open", timeout)
                return
            self._thread = None
        with self._lock:
            self.overlap.close()
            self.engine.close()

    def _run(self) -> None:
        intake, overlap = self.engine.intake, self.overlap
        while not intake.closed.is_set():
            intake.wake.clear()  # before taking: whatever arrives later sets it again and ends the wait below
            with self._lock:
                held = self._held()  # paused or asleep: no step, and new requests wait in the intake
                outputs = [] if held or self._draining else self.engine.take_intake()
                busy = not held and overlap.has_unfinished_requests()
                polling = not busy and not held and self._kv_transfers()  # pages held for a peer
                if busy or polling:
                    try:
                        outputs += overlap.step()
                    except Exception as err:  # a failed step fails its requests, never the loop
                        logger.exception("engine step failed")
                        self._fail_all(err)
                        continue
            for out in outputs:
                if isinstance(out, RequestFailure):
                    self._deliver(out.request_id, out.error)
                else:
                    self._deliver(out.request_id, out)
            if not busy:
                intake.wake.wait(0.005 if polling else 0.05)
            elif self._kv_waits():
                intake.wake.wait(0.002)
            elif self._stats_waiting.is_set():
                time.sleep(0.0005)  # let the stats() caller blocked on the lock take it

    def _kv_transfers(self) -> bool:
        check = getattr(self.engine, "has_kv_transfers", None)  # LLMEngine's (a stand-in core has none)
        return check is not None and check()

    def _kv_waits(self) -> bool:
        check = getattr(self.engine, "only_waiting_for_kv", None)
        return check is not None and not self.overlap.in_flight and check()

    def _held(self) -> bool:
        state = getattr(self.engine, "pause_state", None)  # LLMEngine's (a stand-in core has none)
        return state is not None and state.holds

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
        self.overlap.in_flight.clear()  # their rows' sequences are aborted below
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            self._deliver(request_id, err)

    @property
    def processor(self) -> Processor:
        """The engine's one way in: `processor.process(...)` makes the EngineRequest `submit` takes."""
        return self.engine.processor

    async def submit(self, request: EngineRequest, queue: asyncio.Queue, tag: Any = None) -> None:
        """Queue a request the processor checked, for the step thread. Its grammar's compilation is
        awaited here (GrammarError, the server's 400, for a schema the grammar library rejects), so the
        step thread never waits for one. From then on `queue` receives `(tag, delta)` each step the
        request advances (a RequestOutput of what is new; the last one has `finished`), or `(tag,
        exception)` if the request fails. Several requests may share a queue; `abort` stops one."""
        structured = request.params.structured
        if request.grammar is None and structured is not None:  # made by another processor (the Ray ingress)
            request = dataclasses.replace(request, grammar=self.engine.grammar_compiler.submit(structured))
        if isinstance(request.grammar, concurrent.futures.Future):
            # Shielded: a caller that goes away must not cancel a compilation other requests share.
            await asyncio.shield(asyncio.wrap_future(request.grammar))
        if getattr(self.engine, "is_sleeping", lambda: False)():  # EngineSleepingError: the server's 503
            self.engine.pause_state.check_serving()
        claim(request.request_id, self._streams, self.engine.closed)
        self._streams[request.request_id] = (asyncio.get_running_loop(), queue, tag)
        self.engine.intake.put(request)
        self.start()

    async def generate(
        self,
        request_id: str | None = None,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's delta each time it advances (sum them with OutputAccumulator for whole
        outputs); aborts the request if the caller stops early. `lora_request`: its adapter (None: the base)."""
        request = self.processor.process(
            request_id or f"req-{next(self._ids)}", prompt, sampling_params, prompt_token_ids, lora_request=lora_request
        )
        async for delta in stream_deltas(self, request):
            yield delta

    # ---- LoRA adapters -------------------------------------------------------------------------
    async def add_lora(self, lora_request: Any) -> None:
        """Load an adapter at run time: its files read on a worker thread, then registered between two
        steps. LoRAError (400) for an adapter that cannot be served or a name already loaded."""
        engine = self.engine
        if engine.lora is None:
            raise LoRAError("LoRA adapters are not enabled: start the engine with --enable-lora")
        weights = await asyncio.to_thread(engine.lora.read, lora_request)
        await asyncio.to_thread(self._between_steps, engine.add_lora, lora_request, weights)

    async def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter between two steps (LoRANotFoundError: 404); its running requests finish."""
        await asyncio.to_thread(self._between_steps, self.engine.remove_lora, lora_name)

    def list_loras(self) -> list:
        """The adapters loaded now (a snapshot: any thread)."""
        return self.engine.list_loras()

    def _between_steps(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the core with the step lock held (between two steps), as stats() reads it."""
        self._stats_waiting.set()
        with self._lock:
            self._stats_waiting.clear()
            return fn(*args)

    # ---- training loops: new weights, pause, sleep (jaxserve/runner/weight_control.py) ----------
    # Each runs on the step thread's lock, between two steps, after the steps in flight are processed.
    async def update_weights(self, params: Any = None, weight_version: Any = None, **options: Any) -> Any:
        """`LLMEngine.update_weights` between two steps; running requests go on with the new weights."""
        return await asyncio.to_thread(self._control, self.engine.update_weights, params, weight_version, **options)

    async def pause(self, mode: str = "abort") -> None:
        """vLLM's pause_generation: "abort" ends the requests now, "wait" lets them finish first (new
        ones wait in the intake), "keep" freezes them until resume(). Requests sent meanwhile wait."""
        check_mode(mode)
        if mode == "wait":
            self._draining = True  # the step thread takes no new request from now on
            while self.overlap.has_unfinished_requests():
                await asyncio.sleep(0.005)
        await asyncio.to_thread(self._control, self.engine.pause, mode)

    async def resume(self) -> None:
        await asyncio.to_thread(self._between_steps, self.engine.resume)
        self.engine.intake.wake.set()

    async def is_paused(self) -> bool:
        return self.engine.is_paused()

    async def sleep(self, level: int = 1) -> None:
        """vLLM's sleep (the requests held are aborted; new ones are refused until wake_up)."""
        await asyncio.to_thread(self._control, self.engine.sleep, level)

    async def wake_up(self, tags: Any = None) -> None:
        await asyncio.to_thread(self._between_steps, self.engine.wake_up, tags)
        self.engine.intake.wake.set()

    async def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    async def update_weights_from_disk(
        self, model_path: str, load_format: Any = None, weight_version: Any = None, *, abort_all_requests: bool = False
    ) -> tuple[Any, int]:
        """SGLang's: new weights read from a checkpoint directory between two steps (the requests held
        aborted first with `abort_all_requests`); (the UpdateReport, how many were aborted)."""

        def run() -> tuple[Any, int]:
            aborted = abort_all(self.engine) if abort_all_requests else []
            for out in aborted:
                self._deliver(out.request_id, out)
            return self.engine.update_weights_from_disk(model_path, load_format, weight_version), len(aborted)

        return await asyncio.to_thread(self._control, run)

    @property
    def weight_version(self) -> Any:
        return getattr(self.engine, "weight_version", None)

    def _control(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn` between two steps, the steps in flight processed first; the deltas of both delivered."""

        def run() -> Any:
            outputs = self.overlap.flush()
            try:
                result = fn(*args, **kwargs)
            finally:
                self._draining = False
            for out in outputs + (result if isinstance(result, list) else []):
                self._deliver(out.request_id, out)
            return result

        return self._between_steps(run)

    def abort(self, request_id: str) -> None:
        """Abort between steps (queued behind the request's own admission, so it cannot overtake it);
        any thread may call it. Its queue gets a last delta with finish_reason 'abort'."""
        self.engine.intake.put(Abort(request_id))

    def stats(self) -> dict:
        return self._between_steps(self.engine.stats)
