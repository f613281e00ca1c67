"""The one way in: a prompt (text, token ids or chat messages) becomes a checked `EngineRequest`, once.

Every front end goes through `Processor.process`: the server's translation (`server/requests.py`),
`LLM.generate` and `LLM.chat`, `AsyncLLMEngine.generate`, `EngineCore.add_request`, the mock engine
and the Ray ingress. It tokenizes the prompt once (a list the request, its sequences and its
detokenizer then share), checks everything that depends only on the prompt, the params and what the
engine can ever serve (`Limits`), and starts the grammar's compilation. An engine takes the result as
it is (`submit`, `admit`) and checks only what depends on its state now: `claim` (the id is free, the
engine is open).

The context-length rule, the same offline and served: a request whose prompt plus `max_tokens` passes
`max_model_len` is refused, never capped. A request that leaves `max_tokens` unset (chat completions)
gets what is left of the context, `room(prompt)`, or the model's `max_new_tokens` if lower (vLLM's
fill); elsewhere `max_tokens` is always set (SamplingParams' 16, completions' 16).

No jax here: the server imports this with the mock engine too.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Container, Mapping, Sequence

import numpy as np

from jaxserve.errors import EngineClosedError, RequestError
from jaxserve.sampling.params import SamplingParams


class PromptError(RequestError):
    """A request the processor refuses; `code` names the rule (the server's error code)."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


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
    max_logprobs: int = 20  # the most top logprobs a request may ask for (max_logprobs; vLLM's default 20)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as token ids (made once, never copied after), with its text if it came as text."""

    token_ids: list[int]
    text: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRequest:
    """A checked request, as every engine takes it. `grammar`: None, a CompiledGrammar, or a
    concurrent Future of one (compiling on the compiler's thread); `arrival_time` on time.monotonic()."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    grammar: Any = None
    lora_request: Any = None  # a LoRARequest: the adapter it runs under (None: the base model)
    arrival_time: float = 0.0


def check_open(closed: bool) -> None:
    """The one "engine closed" refusal."""
    if closed:
        raise EngineClosedError(
            "this engine is closed (its executables, weights and KV cache are released); build a new one"
        )


def claim(request_id: str, live: Container[str], closed: bool = False) -> None:
    """The checks that depend on an engine's state, in one place: it is open and `request_id` is not
    one of its `live` requests."""
    check_open(closed)
    if request_id in live:
        raise RequestError(f"request id {request_id!r} is already in use")


class Processor:
    """Prompts in, checked EngineRequests out. `grammars`: spec -> concurrent Future of its compiled
    grammar (the engine's GrammarCompiler.submit), or None to leave compiling to the engine. Reads only
    fixed things (limits, tokenizer), so any thread may call it."""

    def __init__(self, limits: Limits, tokenizer: Any = None, grammars: Callable[[Any], Any] | None = None):
        self.limits = limits
        self.tokenizer = tokenizer
        self.grammars = grammars

    # ---- prompts ---------------------------------------------------------------------------------
    def prompt(self, text: str | None = None, token_ids: Sequence[int] | None = None) -> Prompt:
        """Exactly one of the prompt's text and its token ids, as a Prompt (not yet checked)."""
        if (text is None) == (token_ids is None):
            raise PromptError("give exactly one of prompt or prompt_token_ids")
        if text is not None:
            if self.tokenizer is None:
                raise PromptError(
                    "this model has no tokenizer: pass the prompt as token ids, or start with tokenizer=PATH",
                    code="no_tokenizer",
                )
            return Prompt(_as_list(self.tokenizer.encode(text)), text)
        return Prompt([int(t) for t in token_ids])

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        renderer: Any,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: Any = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prompt:
        """A conversation rendered with `renderer` (server.chat.ChatRenderer: the template
        /v1/chat/completions and LLM.chat share) and tokenized without special tokens (the template
        writes its own BOS)."""
        if self.tokenizer is None:
            raise PromptError(
                "this model has no tokenizer, so chat is not available: send the prompt as token ids, "
                "or start with tokenizer=PATH",
                code="no_tokenizer",
            )
        if continue_final_message and add_generation_prompt:
            raise PromptError("continue_final_message and add_generation_prompt cannot both be true")
        if not messages:
            raise PromptError("chat needs at least one message", code="empty_prompt")
        try:
            text = renderer.render(
                [chat_message(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                documents=documents,
                chat_template_kwargs=chat_template_kwargs,
            )
        except ValueError as err:  # ChatTemplateError: the template refused the conversation
            raise PromptError(str(err), code="chat_template_error") from None
        return Prompt(_as_list(self.tokenizer.encode(text, add_special_tokens=False)), text)

    def room(self, prompt: Prompt) -> int:
        """What is left of the context after the prompt (at least 1: a longer prompt is refused by
        `process`): an unset max_tokens' fill."""
        return max(1, self.limits.max_model_len - len(prompt.token_ids))

    # ---- the request ------------------------------------------------------------------------------
    def process(
        self,
        request_id: str,
        prompt: str | Prompt | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        lora_request: Any = None,
        arrival_time: float | None = None,
        grammar: Any = None,
    ) -> EngineRequest:
        """The checked EngineRequest (PromptError / RequestError for what could never be served);
        its grammar's compilation started when `grammars` was given."""
        if not isinstance(prompt, Prompt):
            prompt = self.prompt(prompt, prompt_token_ids)
        elif prompt_token_ids is not None:
            raise PromptError("give exactly one of prompt or prompt_token_ids")
        params = params if params is not None else SamplingParams()
        self.check(prompt.token_ids, params)
        if grammar is None and params.structured is not None and self.grammars is not None:
            grammar = self.grammars(params.structured)
        return EngineRequest(
            request_id,
            prompt.token_ids,
            params,
            prompt.text,
            grammar,
            lora_request,
            time.monotonic() if arrival_time is None else arrival_time,
        )

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """Raise PromptError for a request that could never be served: every rule, once."""
        limits = self.limits
        vocab = limits.vocab_size
        if not ids:
            raise PromptError("the prompt is empty: a prompt must have at least one token", code="empty_prompt")
        array = np.asarray(ids)
        if array.min() < 0 or array.max() >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab]
            raise PromptError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in (params.logit_bias or ()) if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"logit_bias token id(s) {bad[:5]} are outside the vocabulary [0, {vocab})")
        limit, n_prompt = limits.max_model_len, len(ids)
        need = n_prompt + params.max_tokens
        if need > limit:
            raise PromptError(
                f"this model's maximum context length is {limit} tokens; the request asks for {need} "
                f"({n_prompt} in the prompt, {params.max_tokens} to generate)",
                code="context_length_exceeded",
            )
        needed = limits.pages_for(need)
        if limits.sliding_window is not None:  # decode pages behind the window go back to the pool
            needed = min(needed, limits.pages_for(n_prompt) + limits.pages_for(limits.sliding_window) + 1)
        usable = limits.usable_pages
        if needed > usable:
            raise PromptError(f"prompt + max_tokens needs {needed} KV pages; a replica's cache has {usable}")
        if params.n > limits.max_num_seqs:
            raise PromptError(f"n={params.n} exceeds max_num_seqs={limits.max_num_seqs}")
        forked = limits.pages_for(n_prompt) + params.n - 1  # the n samples fork with a page each
        if forked > usable:
            raise PromptError(
                f"n={params.n} samples of a {n_prompt}-token prompt need {forked} KV pages to start; "
                f"a replica's cache has {usable}"
            )
        if params.structured is not None and limits.structured_refusal is not None:
            raise PromptError(limits.structured_refusal)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > limits.max_logprobs:
                raise PromptError(f"{name}={asked} is more than max_logprobs={limits.max_logprobs} (--max-logprobs)")
        if params.prompt_logprobs is not None and not limits.prompt_logprobs:
            raise PromptError(
                "prompt_logprobs needs the engine started with enable_prompt_logprobs=True "
                "(--enable-prompt-logprobs), which compiles the scoring steps"
            )


def _as_list(ids: Sequence[int]) -> list[int]:
    """A tokenizer's ids as the one list the request keeps (its own list when it gave one: no copy)."""
    return ids if type(ids) is list else [int(t) for t in ids]


def chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as the template sees it: content as text (OpenAI's text parts joined)."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise PromptError(f"a chat message must be a mapping with a 'role', got {message!r}")
    content = message.get("content")
    if isinstance(content, (list, tuple)):
        if any(not isinstance(p, Mapping) or p.get("type", "text") != "text" for p in content):
            raise PromptError("only text content parts are supported")
        content = "".join(str(p.get("text") or "") for p in content)
    return {**message, "content": "" if content is None else content}
