"""From sampled ids to what a request's caller sees (no jax): detokenization, stop conditions,
logprob entries and each advanced request's delta (a RequestOutput of what is new since the last);
`OutputAccumulator` sums deltas into whole outputs.

The engine hands every sampled token here once its id is on the host (`resolve_token`); the
scheduler decides nothing from text. The mock engine (jaxserve.testing) cuts stop strings with the
same `find_stop_string` and `held_back` (`structured.markers`, which the server's parsers share too),
so the server tests see the real engine's text rules.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import Any, AsyncIterator, Sequence as SequenceOf

from jaxserve.engine.sequence import Sequence
from jaxserve.model.ragged import is_placeholder
from jaxserve.sampling.params import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams
from jaxserve.structured.markers import held_back  # also the mock engine's: one rule for cutting stop strings

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Request:
    """One request in the engine: its n sequences (samples) share the prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    prompt_logprobs_emitted: bool = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def top_entry(ids: Any, logprobs: Any) -> dict[int, float]:
    """{token id: logprob} of a top-N on the host, without the alternatives whose logprob is not
    finite (-inf: a token the grammar masked; NaN: nothing to report), so every consumer of the
    engine's logprob entries (the server's JSON, `LLM.generate`'s outputs) sees real numbers only."""
    return {int(t): v for t, lp in zip(ids, logprobs) if math.isfinite(v := float(lp))}


def find_stop_string(text: str, stops: SequenceOf[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text` (its index and itself), or None."""
    hits = [(text.find(s), s) for s in stops]
    hits = [(i, s) for i, s in hits if i >= 0]
    return min(hits) if hits else None


class OutputProcessor:
    """Turns sampled ids into sequence state and RequestOutputs; owns no scheduling state."""

    def __init__(self, tokenizer: Any, eos_token_ids: SequenceOf[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.weight_version: int | str = 0  # stamped on every delta (set by update_weights)

    def detokenizer(self, prompt_ids: list[int], params: SamplingParams):
        """A sequence's incremental detokenizer (None without a tokenizer: outputs have ids only)."""
        if self.tokenizer is None:
            return None
        from jaxserve.loading.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=params.skip_special_tokens, prompt_ids=prompt_ids
        )

    def resolve_token(self, seq: Sequence, index: int, token: int) -> str | None:
        """`token` is output `index` of `seq` (a placeholder until now, or just appended): detokenize
        it, advance the grammar, and return the finish reason if the sequence stops here ("stop",
        "length"), having dropped any output after it (the placeholder of a step dispatched later)."""
        seq.output_token_ids[index] = token
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        params = seq.params
        if seq.detokenizer is not None:
            seq.text += seq.detokenizer.add(token)
        n_out = index + 1
        reason = None
        eos = token in self.eos_token_ids
        if seq.grammar is not None:
            self.advance_grammar(seq, index, token)
        if n_out >= params.min_tokens:
            if (not params.ignore_eos and eos) or token in params.stop_token_ids:
                reason = "stop"
            elif params.stop and self._cut_at_stop_string(seq):
                reason = "stop"
            elif seq.grammar is not None and seq.grammar.is_finished:
                reason = "stop"  # the grammar is complete and allows only EOS: end now, without that step
        if reason is None and (n_out >= params.max_tokens or len(seq.prompt_token_ids) + n_out >= self.max_model_len):
            reason = "length"
        if reason is not None:
            del seq.output_token_ids[n_out:]
            if seq.detokenizer is not None and seq.stop_text_len is None:
                seq.text += seq.detokenizer.flush()
        return reason

    def advance_grammar(self, seq: Sequence, index: int, token: int) -> None:
        """Output `index` of a constrained sequence is `token`: its grammar takes it, once (async
        scheduling hands it over before the token is otherwise processed, for the next step's mask;
        the grammar has taken every output token before the ones it counts)."""
        if index < seq.grammar.num_tokens or token in self.eos_token_ids:
            return
        # The mask allowed it, so this cannot fail; if it did the matcher allows only EOS from now on.
        if not seq.grammar.advance(token):
            logger.warning("%s: the grammar refused token %d: %s", seq.seq_id, token, seq.grammar.error)

    @staticmethod
    def _cut_at_stop_string(seq: Sequence) -> bool:
        """Keep the text before the earliest stop string (or through it, include_stop_str_in_output)."""
        hit = find_stop_string(seq.text, seq.params.stop)
        if hit is None:
            return False
        index, stop = hit
        seq.stop_text_len = index + (len(stop) if seq.params.include_stop_str_in_output else 0)
        seq.text = seq.text[: seq.stop_text_len]
        return True

    @staticmethod
    def record_logprobs(seq: Sequence, sampled: Any, i: int) -> None:
        """The logprob entry of row i's sample (`sampled`: a SampleOutput on the host). Alternatives
        whose logprob is not finite are left out: the tokens a grammar masked (-inf, which the top-N
        returns when the grammar allows fewer than N tokens). The sampled token's own is kept (it was
        allowed, so it is finite)."""
        top = seq.params.logprobs
        entry = top_entry(sampled.top_ids[i, :top], sampled.top_logprobs[i, :top])
        entry[int(sampled.tokens[i])] = float(sampled.logprobs[i])
        seq.logprobs.append(entry)
        seq.cumulative_logprob += float(sampled.logprobs[i])

    @staticmethod
    def prompt_targets(seq: Sequence, start: int, num_tokens: int) -> list[int] | None:
        """The next prompt token of each computed position, when this chunk has prompt tokens to score."""
        prompt = seq.prompt_token_ids
        if seq.prompt_logprobs is None or start + 1 >= len(prompt):
            return None
        return [prompt[p + 1] if p + 1 < len(prompt) else 0 for p in range(start, start + num_tokens)]

    @staticmethod
    def record_prompt_logprobs(seq: Sequence, start: int, targets: list[int], scores: Any, i: int) -> None:
        top = seq.params.prompt_logprobs
        for j in range(len(targets)):
            position = start + j + 1  # the prompt token that position start + j predicts
            if position >= len(seq.prompt_token_ids):
                break
            entry = top_entry(scores.top_ids[i, j, :top], scores.top_logprobs[i, j, :top])
            entry[targets[j]] = float(scores.target_logprobs[i, j])  # the prompt token's own, whatever it is
            seq.prompt_logprobs[position] = entry  # a recompute after preemption rewrites the same values

    def delta(self, request: Request, spec_metrics: dict | None = None) -> RequestOutput | None:
        """What is new in `request` since its last delta (None: nothing): per sample, the output tokens
        whose ids reached the host, their logprob entries, the text released (a tail that may still
        become a stop string is held back while running) and the finish reason once. The cost is that
        of the new tokens, whatever the context length. The prompt's logprobs ride in the first delta."""
        if len(request.seqs) == 1:
            out = self._sample_delta(request.seqs[0])
            outputs = [] if out is None else [out]
        else:
            outputs = [o for o in (self._sample_delta(s) for s in request.seqs) if o is not None]
        if not outputs:
            return None
        seqs = request.seqs
        finished = request.finished
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None and not request.prompt_logprobs_emitted:
            request.prompt_logprobs_emitted = True
            prompt_logprobs = list(seqs[0].prompt_logprobs)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            metrics=self._metrics(request, finished, spec_metrics),
            weight_version=self.weight_version,
            kv_transfer_params=seqs[0].kv_transfer_params_out if finished else None,
        )

    @staticmethod
    def _metrics(request: Request, finished: bool, spec_metrics: dict | None) -> RequestMetrics:
        seqs = request.seqs
        if len(seqs) == 1:  # the usual request: its one sample's times, as the general case gives them
            s = seqs[0]
            return RequestMetrics(
                request.arrival_time,
                s.first_scheduled_time or None,
                s.first_token_time or None,
                (s.finished_time or 0.0) if finished else None,
                **(spec_metrics or {}),
            )
        return RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=min((t for t in (s.first_scheduled_time for s in seqs) if t), default=None),
            first_token_time=min((t for t in (s.first_token_time for s in seqs) if t), default=None),
            finished_time=max((s.finished_time or 0.0 for s in seqs), default=None) if finished else None,
            **(spec_metrics or {}),
        )

    @staticmethod
    def _sample_delta(seq: Sequence) -> CompletionOutput | None:
        ids = seq.output_token_ids
        end = len(ids)
        while end > seq.ids_emitted and is_placeholder(ids[end - 1]):  # sampled, not yet on the host
            end -= 1
        text_end = len(seq.text)
        if not seq.is_finished:
            text_end -= held_back(seq.text, seq.params.stop)
        finishing = seq.is_finished and not seq.finish_emitted
        if end == seq.ids_emitted and text_end <= seq.text_emitted and not finishing:
            return None
        want_logprobs = seq.params.logprobs is not None
        out = CompletionOutput(
            seq.index,
            ids[seq.ids_emitted : end],
            seq.text[seq.text_emitted : text_end],
            seq.finish_reason,
            seq.logprobs[seq.ids_emitted : end] if want_logprobs else None,
            seq.cumulative_logprob if want_logprobs else None,
        )
        seq.ids_emitted = end
        seq.text_emitted = max(seq.text_emitted, text_end)
        seq.finish_emitted = seq.is_finished
        return out


class OutputAccumulator:
    """Cumulative RequestOutputs from the engine's deltas: `add` each delta, get the request's whole
    output so far (what `LLM.generate` returns; the server keeps its own per-choice state instead)."""

    def __init__(self):
        self.outputs: dict[str, RequestOutput] = {}

    def add(self, delta: RequestOutput) -> RequestOutput:
        total = self.outputs.get(delta.request_id)
        if total is None:
            total = self.outputs[delta.request_id] = RequestOutput(
                delta.request_id, delta.prompt, delta.prompt_token_ids, [], delta.finished
            )
        by_index = {o.index: o for o in total.outputs}
        for new in delta.outputs:
            old = by_index.get(new.index)
            if old is None:
                old = by_index[new.index] = CompletionOutput(
                    new.index, [], "", None, [] if new.logprobs is not None else None
                )
                total.outputs.append(old)
            old.token_ids.extend(new.token_ids)
            old.text += new.text
            if new.logprobs is not None:
                old.logprobs.extend(new.logprobs)
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason = new.finish_reason
        total.outputs.sort(key=lambda o: o.index)
        total.finished = delta.finished
        total.metrics = delta.metrics
        total.weight_version = delta.weight_version
        total.kv_transfer_params = delta.kv_transfer_params or total.kv_transfer_params
        if delta.prompt_logprobs is not None:
            total.prompt_logprobs = delta.prompt_logprobs
        return total

    def pop(self, request_id: str) -> RequestOutput:
        return self.outputs.pop(request_id)


async def stream_deltas(engine: Any, request: Any) -> AsyncIterator[RequestOutput]:
    """One EngineRequest's deltas through `engine.submit` (AsyncLLMEngine or the mock engine), as an
    async iterator that raises the request's error and aborts it if the caller stops early."""
    queue: asyncio.Queue = asyncio.Queue()
    await engine.submit(request, queue)
    request_id = request.request_id
    finished = False
    try:
        while not finished:
            _, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            engine.abort(request_id)
