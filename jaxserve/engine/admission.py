"""The one request check: what an engine could never serve is refused at once, before it queues.

The server (`AsyncLLMEngine.submit`), `LLM.generate`, `EngineCore.add_request` and the mock engine
all call `check_request` with the engine's `Limits`, once per request, so a bad request raises
RequestError (the server's 400) instead of hanging or failing inside XLA.
"""

from __future__ import annotations

import dataclasses

from jaxserve.errors import RequestError
from jaxserve.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Limits:
    """What an engine can ever serve, read from its settings, model and KV cache."""

    vocab_size: int
    max_model_len: int
    page_size: int
    usable_pages: int  # a replica's pages a request may hold (the padding page and the watermark excluded)
    max_num_seqs: int
    sliding_window: int | None = None  # every layer windowed: decode pages behind the window are released
    # Why structured output cannot be served here (None: it can).
    structured_refusal: str | None = None
    prompt_logprobs: bool = False  # the scoring steps are compiled (enable_prompt_logprobs)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


def check_request(ids: list[int], params: SamplingParams, limits: Limits) -> None:
    """Raise RequestError for a request that could never be served."""
    vocab = limits.vocab_size
    if not ids:
        raise RequestError("a prompt must have at least one token")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {vocab})")
    bad = [t for t in (params.logit_bias or ()) if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"logit_bias token id(s) {bad[:5]} are outside the vocabulary [0, {vocab})")
    limit = limits.max_model_len
    if len(ids) >= limit:
        raise RequestError(f"prompt of {len(ids)} tokens leaves no room to generate within max_model_len={limit}")
    needed = limits.pages_for(min(len(ids) + params.max_tokens, limit))
    if limits.sliding_window is not None:  # decode pages behind the window go back to the pool
        needed = min(needed, limits.pages_for(len(ids)) + limits.pages_for(limits.sliding_window) + 1)
    usable = limits.usable_pages
    if needed > usable:
        raise RequestError(f"prompt + max_tokens needs {needed} KV pages; a replica's cache has {usable}")
    if params.n > limits.max_num_seqs:
        raise RequestError(f"n={params.n} exceeds max_num_seqs={limits.max_num_seqs}")
    forked = limits.pages_for(len(ids)) + params.n - 1  # the n samples fork with a page each
    if forked > usable:
        raise RequestError(f"n={params.n} samples of a {len(ids)}-token prompt need {forked} KV pages to start; "
                           f"a replica's cache has {usable}")
    if params.structured is not None and limits.structured_refusal is not None:
        raise RequestError(limits.structured_refusal)
    if params.prompt_logprobs is not None and not limits.prompt_logprobs:
        raise RequestError("prompt_logprobs needs the engine started with enable_prompt_logprobs=True "
                           "(--enable-prompt-logprobs), which compiles the scoring steps")
