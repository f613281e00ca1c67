"""A deterministic stand-in for `AsyncLLMEngine`, for testing and fuzzing the HTTP layer without a model.

Same interface as the real engine (`jaxserve.server.engine_protocol.ServingEngine`: `tokenizer`,
`max_model_len`, `config`, `start`, `submit`, `abort`, `stats`, `shutdown`; also `generate`,
`from_settings` and `.engine`; LoRA adapters: `add_lora`, `remove_lora`, `list_loras`, `submit(...,
lora_request=)`, `stats()["lora"]`, in `mock_lora`), the same SamplingParams (every field), same threading model (a
background step loop that puts deltas into the caller's queue), and the same output contract (deltas:
new `token_ids`/`text`/logprobs per step, `finish_reason` "stop" | "length" | "abort" once).

What it "generates" (JetStream's mock in spirit): output token k of a request is a pure function of
the prompt's token ids and k (and, when sampling, of the seed and the sibling index), drawn from the
letters a-z and space, with the end-of-sequence id now and then (a request with a LoRA adapter
draws other tokens: a function of the adapter's name too). So a solo run and a run under load
give the same tokens, which is what the load tests check. Every step takes `token_delay` seconds and
advances every running sequence by one token; at most `max_num_seqs` run at once, the rest wait.

Pages are simulated: a request reserves ceil(min(prompt + max_tokens, max_model_len) / page_size) pages
per sibling on admission and frees them when it finishes or is aborted, so `stats()["pages_used"]`
returning to 0 shows that nothing leaked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import math
import re
import threading
import time
from typing import Any, AsyncIterator

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.output_processor import find_stop_string, held_back, stream_deltas
from jaxserve.engine.processor import EngineRequest, Limits, Processor, claim
from jaxserve.errors import RequestError
from jaxserve.lora.request import LoRARequest
from jaxserve.planning.memory import MemoryPlan
from jaxserve.sampling.params import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams
from jaxserve.testing.mock_lora import MockLoRAManager, read_adapter_config
from jaxserve.testing.mock_sleep import MockSleepMode

# ----------------------------------------------------------------------------------------------
# A byte-level tokenizer: ids 0..3 are specials (as in jaxserve's trained byte-level tokenizers),
# ids 4..259 the bytes.
# ----------------------------------------------------------------------------------------------

SPECIALS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
NUM_SPECIAL = len(SPECIALS)
EOS_ID = 0
VOCAB_SIZE = NUM_SPECIAL + 256
ALPHABET = "abcdefghijklmnopqrstuvwxyz "
EOS_ONE_IN = 48  # roughly one generated token in 48 is EOS (unless ignore_eos)


class MockTokenizer:
    """Bytes as tokens; the four special strings are parsed out of text."""

    kind = "mock"
    vocab_size = VOCAB_SIZE
    bos_token_id = EOS_ID
    eos_token_ids = (EOS_ID,)
    eos_token_id = EOS_ID
    pad_token_id = 1
    all_special_ids = tuple(range(NUM_SPECIAL))
    add_bos_token = False
    path = None
    _special_re = re.compile("|".join(re.escape(s) for s in SPECIALS))

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template

    def __len__(self) -> int:
        return VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        del add_special_tokens  # like the trained byte-level tokenizers: no BOS added
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids.extend(b + NUM_SPECIAL for b in text[pos : m.start()].encode("utf-8"))
            ids.append(SPECIALS.index(m.group(0)))
            pos = m.end()
        ids.extend(b + NUM_SPECIAL for b in text[pos:].encode("utf-8"))
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = bytearray()
        parts: list[str] = []
        for i in ids:
            i = int(i)
            if i >= NUM_SPECIAL:
                out.append(i - NUM_SPECIAL)
            elif not skip_special_tokens:
                parts.append(out.decode("utf-8", errors="replace"))
                out.clear()
                parts.append(SPECIALS[i])
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)

    def id_to_token(self, i: int) -> str | None:
        i = int(i)
        if 0 <= i < NUM_SPECIAL:
            return SPECIALS[i]
        if NUM_SPECIAL <= i < VOCAB_SIZE:
            return bytes([i - NUM_SPECIAL]).decode("latin-1")
        return None

    def token_to_id(self, token: str) -> int | None:
        if token in SPECIALS:
            return SPECIALS.index(token)
        data = token.encode("latin-1", errors="ignore")
        return data[0] + NUM_SPECIAL if len(data) == 1 else None


# ----------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Sibling:
    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    ids_sent: int = 0  # what earlier deltas carried
    text_sent: int = 0
    finish_sent: bool = False


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tag: Any
    digest: bytes
    pages: int
    metrics: RequestMetrics
    siblings: list[_Sibling]
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    done: bool = False
    fail: int = 0  # 1: fail in the first step; 2: after the first token (tests the 500 / stream-error paths)
    lora: LoRARequest | None = None


class MockLLMEngine:
    """What `AsyncLLMEngine.engine` exposes: tokenizer, model_config, config, memory."""

    def __init__(self, config: EngineConfig, tokenizer: Any, memory: MemoryPlan):
        self.config = config
        self.tokenizer = tokenizer
        self.memory = memory
        self.model_config = ModelConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=memory.max_model_len,
            bos_token_id=EOS_ID,
            eos_token_ids=(EOS_ID,),
        )


class MockAsyncLLMEngine(MockSleepMode):  # MockSleepMode: the trainer's routes
    """Deterministic fake of `jaxserve.engine.async_engine.AsyncLLMEngine` (see the module docstring)."""

    is_mock = True

    def __init__(
        self,
        settings: EngineConfig | None = None,
        *,
        token_delay: float = 0.002,
        tokenizer: Any = None,
        fail_marker: str | None = "<<mock-fail>>",
    ):
        settings = settings or EngineConfig(max_num_seqs=16, num_pages=512, page_size=16, max_model_len=512)
        max_model_len = settings.max_model_len or 512
        num_pages = settings.num_pages or 512
        memory = MemoryPlan(
            param_bytes=10_000_000,
            kv_bytes_per_token=2 * 2 * 16 * 2 * 2,
            page_size=settings.page_size,
            num_pages=num_pages,
            max_model_len=max_model_len,
            max_pages_per_seq=math.ceil(max_model_len / settings.page_size),
        )
        self.engine = MockLLMEngine(settings, tokenizer if tokenizer is not None else MockTokenizer(), memory)
        self.token_delay = float(token_delay)
        # A prompt containing this string makes the engine fail that one request in its first step (tests
        # the 500 path); with "-later" appended, after its first token (tests the in-band stream error).
        self.fail_marker = fail_marker
        self._lock = threading.Condition()
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._by_id: dict[str, _Request] = {}
        self._pages_free = num_pages - 1  # page 0 is the padding page, as in the real cache
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead = False
        self._counters = dict(prompt_tokens_total=0, generation_tokens_total=0)
        self._last_step_seconds = 0.0
        self._last_step_bytes = 0
        self.lora = MockLoRAManager(
            settings.enable_lora,
            settings.max_loras,
            settings.max_lora_rank,
            settings.max_cpu_loras,
            settings.lora_modules,
        )

    @classmethod
    def from_settings(cls, settings: EngineConfig, **kwargs: Any) -> "MockAsyncLLMEngine":
        return cls(settings, **kwargs)

    # ---- what the server reads (jaxserve.server.engine_protocol.ServingEngine) ----------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.memory.max_model_len

    @functools.cached_property
    def processor(self) -> Processor:
        """The one way in, over what the mock can serve (its simulated cache, every feature but structured output)."""
        return Processor(self.limits, self.tokenizer)

    @property
    def limits(self) -> Limits:
        return Limits(
            vocab_size=VOCAB_SIZE,
            max_model_len=self.engine.memory.max_model_len,
            page_size=self.engine.memory.page_size,
            usable_pages=self.engine.memory.num_pages - 1,
            max_num_seqs=self.engine.config.max_num_seqs,
            structured_refusal="the mock engine does not implement structured output; serve a model",
            prompt_logprobs=True,  # the mock makes them up for every request
            max_logprobs=self.engine.config.max_logprobs,
        )

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="mock-engine-loop", daemon=True)
            self._thread.start()

    def is_alive(self) -> bool:
        """False once the step thread has stopped after starting, as AsyncLLMEngine's."""
        return self._thread is None or self._thread.is_alive()

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=60)

    # ---- LoRA adapters (jaxserve.testing.mock_lora) ---------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Check and register an adapter (LoRAError: a missing directory or adapter_config.json, a rank
        above max_lora_rank, a module that cannot be adapted, a name or id already loaded)."""
        with self._lock:
            self.lora.check(lora_request)
        await asyncio.to_thread(read_adapter_config, lora_request, self.lora.max_lora_rank)  # off the loop
        with self._lock:
            self.lora.register(lora_request)

    async def remove_lora(self, lora_name: str) -> None:
        """LoRANotFoundError if not loaded; requests running with it finish."""
        with self._lock:
            self.lora.remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        with self._lock:
            return self.lora.list()

    # ---- requests -------------------------------------------------------------------------------
    async def submit(self, request: EngineRequest, queue: asyncio.Queue, tag: Any = None) -> None:
        """Queue a request its processor checked (`processor.process`); here only what depends on
        the mock: its adapter, the simulated cache, its id free and the engine open."""
        self.check_awake()  # asleep: EngineSleepingError (the server's 503)
        request_id, ids, params, lora_request = (
            request.request_id,
            request.prompt_token_ids,
            request.params,
            request.lora_request,
        )
        with self._lock:
            self.lora.check_request(lora_request)
        limit = self.engine.memory.max_model_len
        total = min(len(ids) + params.max_tokens, limit)
        pages = math.ceil(total / self.engine.memory.page_size) * params.n
        if pages > self.engine.memory.num_pages - 1:  # the simulation reserves every sample's pages at once
            raise RequestError(
                f"prompt + max_tokens needs {pages} KV pages; the cache has {self.engine.memory.num_pages - 1}"
            )
        text = self.engine.tokenizer.decode(ids, skip_special_tokens=False) if self.fail_marker else ""
        fail = 0
        if self.fail_marker and self.fail_marker[:-2] + "-later" + self.fail_marker[-2:] in text:
            fail = 2
        elif self.fail_marker and self.fail_marker in text:
            fail = 1
        req = _Request(
            request_id=request_id,
            prompt=request.prompt,
            prompt_ids=ids,
            params=params,
            loop=asyncio.get_running_loop(),
            queue=queue,
            tag=tag,
            pages=pages,
            lora=lora_request,
            digest=hashlib.blake2b(
                repr(ids).encode() + MockLoRAManager.digest_salt(lora_request), digest_size=16
            ).digest(),
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            siblings=[_Sibling(i) for i in range(params.n)],
            fail=fail,
        )
        with self._lock:
            claim(request_id, self._by_id, self._stopping or self._dead)
            self._by_id[request_id] = req
            self._waiting.append(req)
            self._lock.notify_all()

    async def generate(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's deltas, as AsyncLLMEngine.generate does."""
        request = self.processor.process(
            request_id, prompt, sampling_params, prompt_token_ids, lora_request=lora_request
        )
        async for delta in stream_deltas(self, request):
            yield delta

    def abort(self, request_id: str) -> None:
        """Stop a request now; its queue gets a last delta with finish_reason 'abort'."""
        with self._lock:
            req = self._by_id.pop(request_id, None)
            if req is None or req.done:
                return
            if req in self._waiting:
                self._waiting.remove(req)
            if req in self._running:
                self._running.remove(req)
                self._pages_free += req.pages
            req.done = True
            for s in req.siblings:
                if s.finish_reason is None:
                    s.finish_reason = "abort"
            self._deliver(req, self._output(req, finished=True))

    # ---- the step loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._running and not self._stopping:
                    self._lock.wait(timeout=1.0)
                if self._stopping and not self._waiting and not self._running:
                    return
                now = time.monotonic()
                for req in list(self._waiting):
                    if len(self._running) >= self.engine.config.max_num_seqs or req.pages > self._pages_free:
                        break
                    running_loras = [r.lora for r in self._running]
                    if not self.lora.admissible(req.lora, running_loras):
                        continue  # max_loras other adapters run: it waits, those behind it may go
                    self.lora.admit(req.lora, running_loras)
                    self._waiting.remove(req)
                    self._pages_free -= req.pages
                    req.metrics.first_scheduled_time = now
                    self._running.append(req)
                    self._counters["prompt_tokens_total"] += len(req.prompt_ids)
                batch = list(self._running)
            start = time.perf_counter()
            if self.token_delay > 0:
                time.sleep(self.token_delay)
            with self._lock:
                tokens_read = 0
                for req in batch:
                    if req.done:
                        continue
                    self._advance(req)
                    tokens_read += len(req.prompt_ids) + max(len(s.token_ids) for s in req.siblings)
                self._last_step_seconds = time.perf_counter() - start
                self._last_step_bytes = (
                    self.engine.memory.param_bytes + tokens_read * self.engine.memory.kv_bytes_per_token
                )

    def _advance(self, req: _Request) -> None:
        params = req.params
        tok = self.engine.tokenizer
        if params.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = [None] + [
                self._logprob_entry(req.digest + b"p", k, t, params.prompt_logprobs)
                for k, t in enumerate(req.prompt_ids[1:])
            ]
        if req.fail == 1 or (req.fail == 2 and req.siblings[0].token_ids):
            req.done = True
            self._running.remove(req)
            self._pages_free += req.pages
            self._by_id.pop(req.request_id, None)
            self._deliver(req, RuntimeError("mock engine: injected failure while processing this request"))
            return
        for s in req.siblings:
            if s.finish_reason is not None:
                continue
            k = len(s.token_ids)
            token = self._token(req, s.index, k)
            s.token_ids.append(token)
            if params.logprobs is not None:
                entry = self._logprob_entry(req.digest, k, token, params.logprobs)
                s.logprobs.append(entry)
                s.cumulative_logprob += entry[token]
            self._counters["generation_tokens_total"] += 1
            full = tok.decode(s.token_ids, skip_special_tokens=params.skip_special_tokens)
            cut = find_stop_string(full, params.stop)
            if cut is not None:
                pos, stop = cut
                s.text = full[: pos + (len(stop) if params.include_stop_str_in_output else 0)]
                s.finish_reason = "stop"
                continue
            if (token == EOS_ID and not params.ignore_eos) or token in params.stop_token_ids:
                s.finish_reason = "stop"
            elif (
                len(s.token_ids) >= params.max_tokens
                or len(req.prompt_ids) + len(s.token_ids) >= self.engine.memory.max_model_len
            ):
                s.finish_reason = "length"
            # While running, hold back a tail that could still become a stop string.
            s.text = full if s.finish_reason else full[: len(full) - held_back(full, params.stop)]
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.monotonic()
        finished = all(s.finish_reason is not None for s in req.siblings)
        if finished:
            req.done = True
            req.metrics.finished_time = time.monotonic()
            self._running.remove(req)
            self._pages_free += req.pages
            self._by_id.pop(req.request_id, None)
        self._deliver(req, self._output(req, finished))

    def _token(self, req: _Request, sibling: int, k: int) -> int:
        params = req.params
        if params.temperature == 0:
            salt = b""
        else:
            salt = repr((params.seed, sibling, id(req) if params.seed is None else 0)).encode()
        digest = hashlib.blake2b(req.digest + salt + k.to_bytes(4, "little"), digest_size=8).digest()
        h = int.from_bytes(digest, "little")
        token = EOS_ID if h % EOS_ONE_IN == 0 else NUM_SPECIAL + ord(ALPHABET[(h // EOS_ONE_IN) % len(ALPHABET)])
        if token == EOS_ID and (params.ignore_eos or k < params.min_tokens or req.fail):
            token = NUM_SPECIAL + ord(ALPHABET[(h // EOS_ONE_IN) % len(ALPHABET)])
        if k < params.min_tokens and token in params.stop_token_ids:
            token = NUM_SPECIAL + ord("x") if token != NUM_SPECIAL + ord("x") else NUM_SPECIAL + ord("y")
        return token

    @staticmethod
    def _logprob_entry(digest: bytes, k: int, token: int, top: int) -> dict[int, float]:
        h = int.from_bytes(hashlib.blake2b(digest + b"lp" + k.to_bytes(4, "little"), digest_size=8).digest(), "little")
        chosen = -0.01 - (h % 1000) / 1000.0
        entry = {token: chosen}
        alt = NUM_SPECIAL + ord("a")
        step = 1
        while len(entry) < top + 1 and step < 64:
            if alt not in entry:
                entry[alt] = chosen - 0.5 * step
            alt = NUM_SPECIAL + ord(ALPHABET[(step * 7) % 26])
            step += 1
        return entry

    def _output(self, req: _Request, finished: bool) -> RequestOutput:
        """The request's delta: what each sibling produced since the last one."""
        want_lp = req.params.logprobs is not None
        outputs = []
        for s in req.siblings:
            finishing = s.finish_reason is not None and not s.finish_sent
            if len(s.token_ids) == s.ids_sent and len(s.text) <= s.text_sent and not finishing:
                continue
            outputs.append(
                CompletionOutput(
                    index=s.index,
                    token_ids=s.token_ids[s.ids_sent :],
                    text=s.text[s.text_sent :],
                    finish_reason=s.finish_reason,
                    logprobs=[dict(e) for e in s.logprobs[s.ids_sent :]] if want_lp else None,
                    cumulative_logprob=s.cumulative_logprob if want_lp else None,
                )
            )
            s.ids_sent, s.text_sent = len(s.token_ids), max(s.text_sent, len(s.text))
            s.finish_sent = s.finish_reason is not None
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            req.prompt_logprobs_sent = True
            prompt_logprobs = list(req.prompt_logprobs)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_ids),
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            metrics=dataclasses.replace(req.metrics),
        )

    @staticmethod
    def _deliver(req: _Request, item: Any) -> None:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, (req.tag, item))
        except RuntimeError:  # the request's event loop is closed; nobody is listening
            pass

    # ---- observability --------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            total = self.engine.memory.num_pages - 1
            used = total - self._pages_free
            slots = sum(r.pages for r in self._running) * self.engine.memory.page_size
            stored = sum((len(r.prompt_ids) + len(s.token_ids)) for r in self._running for s in r.siblings)
            lora = {"lora": self.lora.stats([r.lora for r in self._running], [r.lora for r in self._waiting])}
            return {
                **(lora if self.lora.enabled else {}),
                "num_running": len(self._running),
                "num_waiting": len(self._waiting),
                # per data-parallel replica, as the real engine reports them (the mock has one)
                "kv_cache_utilization": [stored / slots if slots else 0.0],
                "pages_used": [used],
                "pages_free": [self._pages_free],
                "prefix_cache_hit_rate": 0.0,
                "num_preemptions": 0,
                "compiles_after_warmup": 0,
                "prompt_tokens_total": self._counters["prompt_tokens_total"],
                "generation_tokens_total": self._counters["generation_tokens_total"],
                "last_step_seconds": self._last_step_seconds,
                "last_step_bytes_read": self._last_step_bytes,
            }


def mock_settings(**overrides: Any) -> EngineConfig:
    """EngineConfig defaults that suit the mock (a small page pool, short max_model_len)."""
    values = dict(max_num_seqs=16, num_pages=512, page_size=16, max_model_len=512)
    values.update(overrides)
    return EngineConfig(**values)


__all__ = ["MockAsyncLLMEngine", "MockTokenizer", "mock_settings"]
