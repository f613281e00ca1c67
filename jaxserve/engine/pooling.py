"""The pooling engine's host half: prompts in, one embedding each out (`--runner pooling`).

A small state machine over the `BlockManager`: a prompt is admitted when its pages fit, runs in
chunks of the step's token budget beside other prompts (prompt-only rows of the paged ragged step:
`runner/pool_step.py`), and its pages go back the moment its last chunk is done: no KV outlives a
request, so there is no prefix cache and nothing to preempt. A prompt longer than one step is
pooled across its chunks: MEAN sums each chunk's final-normed states on the host and divides by the
prompt's length at the end; LAST takes its last chunk's last token, CLS its first chunk's first.
The embedding is cut to the request's `dimensions` (Matryoshka) and then normalized, as vLLM does.

`PoolingCore` is synchronous (`step()` runs one device step and returns the requests it finished);
`AsyncPoolingEngine` steps it on a thread of its own for the server. Host only: no jax (the runner
is handed in).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Sequence

import numpy as np

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.pooling_config import PoolerConfig
from jaxserve.errors import RequestError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's `EmbeddingOutput`): `data` float32[dims]; `embedding` as a list."""

    data: np.ndarray

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def hidden_size(self) -> int:
        return int(self.data.shape[0])


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """vLLM's `PoolingRequestOutput` of an embedding: `.outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclasses.dataclass(frozen=True)
class PoolRow:
    """One prompt chunk of a pooling step, as the runner packs it (`runner/pool_step.py`): `tokens`
    at positions `start_pos`.. of a prompt whose pages are `page_ids` (on `replica`)."""

    tokens: Sequence[int]
    start_pos: int
    page_ids: Sequence[int]
    replica: int = 0


@dataclasses.dataclass
class _Prompt:
    request_id: str
    token_ids: list[int]
    dimensions: int
    arrival: float
    replica: int = -1
    computed: int = 0
    total: np.ndarray | None = None  # MEAN: the sum so far
    state: np.ndarray | None = None  # LAST / CLS: the chosen token's state


class PoolingCore:
    """Prompts waiting and running, their pages, and the pooled results. `runner` is a
    `runner.pool_step.PoolingRunner` (or anything with its `run`, `max_rows`, `max_tokens`,
    `max_pages`, `num_replicas`, `page_size`)."""

    def __init__(
        self,
        runner: Any,
        pooler: PoolerConfig,
        hidden_size: int,
        vocab_size: int,
        num_pages: int,
        max_model_len: int,
        tokenizer: Any = None,
        config: Any = None,
    ):
        self.runner, self.pooler, self.tokenizer, self.config = runner, pooler, tokenizer, config
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.page_size = runner.page_size
        self.blocks = BlockManager(
            num_pages, self.page_size, runner.num_replicas, enable_prefix_caching=False, watermark=0.0
        )
        # A prompt must fit the step's page table and an idle pool: the longest one served.
        self.max_model_len = min(max_model_len, runner.max_pages * self.page_size, self.blocks.max_admissible_tokens)
        self.waiting: collections.deque[_Prompt] = collections.deque()
        self.running: list[_Prompt] = []
        self.num_steps = self.num_prompt_tokens = self.num_finished = 0
        self.closed = False

    # ---- requests -------------------------------------------------------------------------------
    def check_prompt(self, token_ids: Sequence[int], dimensions: int | None = None) -> int:
        """ValueError naming what is wrong with a prompt (empty, too long, ids outside the vocabulary,
        dimensions the model cannot give); returns the output size."""
        if len(token_ids) == 0:
            raise ValueError("the prompt is empty: an embedding needs at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the input has "
                f"{len(token_ids)} tokens"
            )
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        return self.pooler.check_dimensions(dimensions, self.hidden_size)

    def add_request(self, request_id: str, token_ids: Sequence[int], dimensions: int | None = None) -> None:
        if self.closed:
            raise RequestError("this engine is closed")
        try:
            dims = self.check_prompt(token_ids, dimensions)
        except ValueError as err:
            raise RequestError(str(err)) from None
        if any(p.request_id == request_id for p in self.waiting) or any(
            p.request_id == request_id for p in self.running
        ):
            raise RequestError(f"request id {request_id!r} is already in use")
        self.waiting.append(_Prompt(request_id, [int(t) for t in token_ids], dims, time.monotonic()))

    def abort_request(self, request_id: str) -> None:
        for prompt in list(self.running):
            if prompt.request_id == request_id:
                self.running.remove(prompt)
                self.blocks.free(request_id)
        self.waiting = collections.deque(p for p in self.waiting if p.request_id != request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> list[tuple[_Prompt, int, int]]:
        """(prompt, start, tokens) chunks of this step: running prompts first, then admissions in
        arrival order, each replica under the token budget and the row count."""
        R = self.runner.num_replicas
        tokens_left, rows_left = [self.runner.max_tokens] * R, [self.runner.max_rows] * R
        chunks = []
        for prompt in self.running:
            rep = prompt.replica
            if tokens_left[rep] and rows_left[rep]:
                n = min(len(prompt.token_ids) - prompt.computed, tokens_left[rep])
                chunks.append((prompt, prompt.computed, n))
                tokens_left[rep] -= n
                rows_left[rep] -= 1
        while self.waiting:
            prompt = self.waiting[0]
            rep = max(range(R), key=lambda r: (tokens_left[r] > 0 and rows_left[r] > 0, self.blocks.num_free_pages(r)))
            if not (tokens_left[rep] and rows_left[rep]) or not self.blocks.can_admit(rep, len(prompt.token_ids)):
                break
            self.waiting.popleft()
            self.blocks.admit(prompt.request_id, rep, prompt.token_ids, reuse_prefix=False)
            prompt.replica = rep
            self.running.append(prompt)
            n = min(len(prompt.token_ids), tokens_left[rep])
            chunks.append((prompt, 0, n))
            tokens_left[rep] -= n
            rows_left[rep] -= 1
        return chunks

    def step(self) -> list[EmbeddingRequestOutput]:
        """Schedule, run one pooling step (waited for), pool; returns the requests it finished."""
        chunks = self.schedule()
        if not chunks:
            if self.waiting:  # nothing running and the first waiting prompt fits no pool: cannot happen
                raise RuntimeError(f"prompt {self.waiting[0].request_id!r} fits no replica's pages")
            return []
        rows = [
            PoolRow(p.token_ids[start : start + n], start, self.blocks.page_ids(p.request_id), p.replica)
            for p, start, n in chunks
        ]
        pooled = self.runner.run(rows)
        self.num_steps += 1
        done = []
        kind = self.pooler.pooling_type
        for i, (prompt, start, n) in enumerate(chunks):
            prompt.computed = start + n
            self.num_prompt_tokens += n
            finished = prompt.computed == len(prompt.token_ids)
            if kind == "MEAN":
                prompt.total = pooled.sums[i] if prompt.total is None else prompt.total + pooled.sums[i]
            elif (kind == "CLS" and start == 0) or (kind == "LAST" and finished):
                prompt.state = pooled.states[i]
            if finished:
                done.append(self._finish(prompt))
        return done

    def _finish(self, prompt: _Prompt) -> EmbeddingRequestOutput:
        self.running.remove(prompt)
        self.blocks.free(prompt.request_id)
        self.num_finished += 1
        vector = prompt.total / len(prompt.token_ids) if self.pooler.pooling_type == "MEAN" else prompt.state
        vector = np.asarray(vector[: prompt.dimensions], np.float32)
        if self.pooler.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return EmbeddingRequestOutput(prompt.request_id, prompt.token_ids, EmbeddingOutput(vector))

    def run_to_completion(self) -> list[EmbeddingRequestOutput]:
        """Step until every request is done (offline: `LLM.embed`); outputs in finishing order."""
        out = []
        while self.has_unfinished_requests():
            out.extend(self.step())
        return out

    def check_serving(self) -> None:
        """Generation on a pooling engine: refused, naming what it serves."""
        raise RequestError("this engine pools (runner='pooling'): it makes embeddings (LLM.embed), not text")

    @property
    def processor(self) -> Any:
        self.check_serving()

    def stats(self) -> dict:
        return dict(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_steps=self.num_steps,
            prompt_tokens_total=self.num_prompt_tokens,
            embeddings_total=self.num_finished,
            free_pages=self.blocks.num_free_pages(0),
            **self.runner.stats(),
        )

    def close(self) -> None:
        self.closed = True
        self.runner.close()


def embed_prompts(
    core: PoolingCore,
    prompts: Any = None,
    prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    pooling_params: Any = None,
    dimensions: int | None = None,
) -> list[EmbeddingRequestOutput]:
    """`LLM.embed`: every prompt checked (RequestError naming the bad one) before any runs, then run to
    completion; outputs in prompt order. `prompts`: a text, texts, or vLLM's {"prompt_token_ids": ids}
    dicts; `prompt_token_ids`: ids, or a list of them. `pooling_params`: anything with `dimensions`
    (vLLM's PoolingParams) or a dict of it."""
    if not isinstance(core, PoolingCore):
        raise RequestError("LLM.embed needs an engine of runner='pooling' (LLM(model, runner='pooling'))")
    if (prompts is None) == (prompt_token_ids is None):
        raise RequestError("give exactly one of prompts and prompt_token_ids")
    if prompt_token_ids is not None:
        one = prompt_token_ids and isinstance(prompt_token_ids[0], (int, np.integer))
        items: list = [list(prompt_token_ids)] if one else [list(ids) for ids in prompt_token_ids]
    else:
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
    if pooling_params is not None:
        given = pooling_params.get("dimensions") if isinstance(pooling_params, dict) else pooling_params.dimensions
        dimensions = given if given is not None else dimensions
    ids_list = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            item = item.get("prompt_token_ids", item.get("prompt"))
        if isinstance(item, str):
            if core.tokenizer is None:
                raise RequestError(f"prompt {i}: this model has no tokenizer; give prompt_token_ids")
            item = core.tokenizer.encode(item)
        try:
            core.check_prompt(item, dimensions)
        except ValueError as err:
            raise RequestError(f"prompt {i}: {err}") from None
        ids_list.append([int(t) for t in item])
    base = f"embed-{core.num_finished}-{time.monotonic_ns()}"
    for i, ids in enumerate(ids_list):
        core.add_request(f"{base}-{i}", ids, dimensions)
    done = {out.request_id: out for out in core.run_to_completion()}
    return [done[f"{base}-{i}"] for i in range(len(ids_list))]


class AsyncPoolingEngine:
    """The server's pooling engine: `embed` from the event loop, steps on one thread of its own (no
    other thread touches the core). What the server reads of an engine (`tokenizer`, `config`,
    `max_model_len`, `stats`, `start`, `shutdown`) has the generation engine's names; `pooling` tells
    the routes apart."""

    pooling = True

    def __init__(self, core: PoolingCore):
        self.core = core
        self._lock = threading.Condition()
        self._adds: list[tuple[str, list[int], int | None, asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._aborts: list[str] = []
        self._futures: dict[str, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    tokenizer = property(lambda self: self.core.tokenizer)
    config = property(lambda self: self.core.config)
    max_model_len = property(lambda self: self.core.max_model_len)
    pooler = property(lambda self: self.core.pooler)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxserve-pooling", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        self.core.close()

    @property
    def processor(self) -> Any:
        """Generation routes reach for the processor: refused with the route this engine serves."""
        raise RequestError(
            "this server runs a pooling model (--runner pooling): it serves POST /v1/embeddings only; "
            "start jaxserve serve without --runner pooling to generate text"
        )

    def stats(self) -> dict:
        """Counters read without waiting for the step in progress."""
        return self.core.stats()

    def check_prompt(self, token_ids: Sequence[int], dimensions: int | None) -> int:
        """The core's checks, on the caller's thread (they read only start-up constants)."""
        return self.core.check_prompt(token_ids, dimensions)

    async def embed(
        self, request_id: str, token_ids: list[int], dimensions: int | None = None
    ) -> EmbeddingRequestOutput:
        """One prompt's embedding; RequestError for what the engine refuses. Cancelled: aborted."""
        (out,) = await self.embed_many([request_id], [token_ids], dimensions)
        return out

    async def embed_many(
        self, request_ids: list[str], prompts: list[list[int]], dimensions: int | None = None
    ) -> list[EmbeddingRequestOutput]:
        """Several prompts' embeddings, in order, queued together (one request's inputs start in the
        same step); RequestError for what the engine refuses. Cancelled: every one aborted."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in prompts]
        with self._lock:
            if self._stopping:
                raise RequestError("the engine is shutting down")
            for request_id, token_ids, future in zip(request_ids, prompts, futures):
                self._adds.append((request_id, token_ids, dimensions, future, loop))
            self._lock.notify()
        try:
            return list(await asyncio.gather(*futures))
        except BaseException:  # cancelled, or one refused: the others are not wanted either
            with self._lock:
                self._aborts.extend(request_ids)
                self._lock.notify()
            raise

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._adds or self._aborts or self.core.has_unfinished_requests()):
                    self._lock.wait()
                if self._stopping:
                    break
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                for request_id, token_ids, dims, future, loop in adds:
                    try:
                        self.core.add_request(request_id, token_ids, dims)
                        self._futures[request_id] = (future, loop)
                    except Exception as err:  # noqa: BLE001 - handed to the request's caller
                        loop.call_soon_threadsafe(_settle, future, None, err)
                for request_id in aborts:
                    self.core.abort_request(request_id)
                    self._futures.pop(request_id, None)
            try:  # the step outside the lock: `embed` on the event loop never waits for the device
                outputs = self.core.step()
            except Exception as err:  # every waiting request learns of it; the thread goes on
                logger.exception("pooling step failed")
                self._fail_all(err)
                continue
            for out in outputs:
                entry = self._futures.pop(out.request_id, None)
                if entry is not None:
                    entry[1].call_soon_threadsafe(_settle, entry[0], out, None)
        self._fail_all(RequestError("the engine shut down"))

    def _fail_all(self, err: Exception) -> None:
        for prompt in list(self.core.running) + list(self.core.waiting):
            self.core.abort_request(prompt.request_id)
        for future, loop in self._futures.values():
            loop.call_soon_threadsafe(_settle, future, None, err)
        self._futures.clear()


def _settle(future: asyncio.Future, result: Any, err: Exception | None) -> None:
    if future.done():
        return
    if err is not None:
        future.set_exception(err)
    else:
        future.set_result(result)
