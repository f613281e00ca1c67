"""Request translation: an OpenAI request body -> token-id prompts and one `SamplingParams`.

Here a request gets the model's generation defaults for the fields it leaves unset, its chat messages
rendered with the chat template, its prompts tokenized, its `max_tokens` default (per endpoint, as
vLLM's), and its 400s: an empty prompt, a prompt with its `max_tokens` past `max_model_len`, chat
without a tokenizer, sampling values `SamplingParams` refuses. What only the engine can check (token
ids in the vocabulary, pages) it checks when the request is submitted.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jaxserve.errors import RequestError
from jaxserve.lora.request import LoRARequest
from jaxserve.sampling.fields import FIELDS
from jaxserve.sampling.params import SamplingParams
from jaxserve.server.chat import ChatTemplateError
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from jaxserve.server.reasoning_parsers import ReasoningParser, get_reasoning_parser
from jaxserve.server.tools import ToolPlan, normalize_tools, plan_tools, template_messages
from jaxserve.structured.errors import GrammarError
from jaxserve.structured.request_fields import spec_from_request

if TYPE_CHECKING:
    from jaxserve.server.state import ServerState

COMPLETION_DEFAULT_MAX_TOKENS = 16

# Request fields handed to SamplingParams as they are, when set: the table's (sampling_fields), and
# logit_bias, whose string keys SamplingParams converts.
_SAMPLING_FIELDS = (*(f.name for f in FIELDS if f.request), "logit_bias")


@dataclasses.dataclass
class Prompt:
    text: str | None  # None: sent as token ids
    token_ids: list[int]


@dataclasses.dataclass
class GenerationRequest:
    """What one HTTP request asks the engine for: every prompt with the same params (`params.n` samples each)."""

    chat: bool
    prompts: list[Prompt]
    params: SamplingParams
    echo: bool = False  # completions: the prompt's text (and logprobs) before each choice's text
    drop_generated: bool = False  # completions with max_tokens 0: echo only, the one generated token dropped
    n_logprobs: int | None = None  # top-N logprobs per output token in the response, None: none asked
    tools: ToolPlan | None = None  # chat with tools: what parses the output into tool_calls
    reasoning: ReasoningParser | None = None  # chat under --reasoning-parser: splits reasoning from content
    reasoning_open: bool = True  # the output starts in reasoning (False: the prompt closed the think block)
    lora_request: LoRARequest | None = None  # the adapter the request's model names (None: the base model)


def translate(state: ServerState, body: CompletionRequest | ChatCompletionRequest, chat: bool) -> GenerationRequest:
    tok = state.tokenizer
    max_len = state.max_model_len
    defaults = state.generation_defaults
    values = {**defaults.request_values(), **_sampling_values(body)}  # the model's defaults; the request's win
    structured = _structured_spec(body)
    if structured is not None:
        values["structured"] = structured
    echo = False
    drop_generated = False
    n_logprobs: int | None = None
    tools: ToolPlan | None = None
    reasoning: ReasoningParser | None = None
    reasoning_open = True

    if chat:
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.options.tool_call_parser)
        if tools.spec is not None:
            if structured is not None:
                field = next(f for f in _STRUCTURED_FIELDS if getattr(body, f) is not None)
                raise APIError(400, f"tool_choice {tools.choice!r} constrains the output to tool calls, and {field} "
                                    "constrains it too; send one of them", param="tool_choice",
                               code="invalid_tools")
            values["structured"] = tools.spec
        text = render_chat(state, body, tools.tools)
        if tok is None:
            raise APIError(400, "this model has no tokenizer, so chat is not available: use /v1/completions with "
                                "token ids", param="messages", code="no_tokenizer")
        prompts = [Prompt(text, list(tok.encode(text, add_special_tokens=False)))]
        if state.options.reasoning_parser is not None:
            reasoning = get_reasoning_parser(state.options.reasoning_parser)
            reasoning_open = not reasoning.reasoning_in_prompt_closed(text)
            if reasoning_open and values.get("structured") is not None:  # the grammar applies to the answer
                values["structured"] = values["structured"].after_reasoning(reasoning.end)
        max_tokens = body.max_tokens or body.max_completion_tokens
        if max_tokens is None:  # as vLLM: the model's max_new_tokens, at most what is left of the context
            left = max(1, max_len - len(prompts[0].token_ids)) if max_len is not None else None
            max_tokens = min((v for v in (defaults.get("max_tokens"), left) if v is not None), default=None)
        values["max_tokens"] = max_tokens if max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        if body.logprobs:
            n_logprobs = body.top_logprobs or 0
            values["logprobs"] = n_logprobs
    else:
        prompts = _completion_prompts(state, body)
        echo = bool(body.echo)
        max_tokens = body.max_tokens
        if max_tokens is None:  # as vLLM: OpenAI's 16, or the model's max_new_tokens if lower
            max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, defaults.get("max_tokens") or COMPLETION_DEFAULT_MAX_TOKENS)
        if max_tokens == 0:  # echo only: the prompt (and its logprobs), nothing generated
            drop_generated = True
            max_tokens = 1
        values["max_tokens"] = max_tokens
        if body.logprobs is not None:
            n_logprobs = body.logprobs
            values["logprobs"] = body.logprobs
            if echo:  # the echoed prompt's logprobs
                values["prompt_logprobs"] = max(body.logprobs, values.get("prompt_logprobs") or 0)

    _check_lengths(prompts, values["max_tokens"], drop_generated, max_len, chat)
    return GenerationRequest(chat, prompts, _sampling_params(values), echo, drop_generated, n_logprobs, tools,
                             reasoning, reasoning_open)


def render_chat(state: ServerState, body: ChatCompletionRequest | TokenizeRequest,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The body's messages (and tools) as prompt text, with the server's chat template (a 400 when it
    refuses them). `tools`: already checked; else the body's are checked here."""
    messages = template_messages(body.messages)
    if tools is None and body.tools:
        tools = normalize_tools(body.tools)
    add_gen = body.add_generation_prompt
    if add_gen is None:
        add_gen = not body.continue_final_message
    try:
        return state.chat.render(messages, add_generation_prompt=add_gen,
                                 continue_final_message=bool(body.continue_final_message), tools=tools,
                                 documents=body.documents, chat_template_kwargs=body.chat_template_kwargs)
    except ChatTemplateError as err:
        raise APIError(400, str(err), param="messages", code="chat_template_error") from None


def _completion_prompts(state: ServerState, body: CompletionRequest) -> list[Prompt]:
    """`prompt` as a string, strings, token ids or lists of token ids: one Prompt each."""
    p = body.prompt
    if isinstance(p, str):
        items: list = [p]
    elif isinstance(p[0], str):
        items = list(p)
    elif isinstance(p[0], int):
        items = [list(p)]
    else:
        items = [list(x) for x in p]
    tok = state.tokenizer
    out = []
    for item in items:
        if isinstance(item, str):
            if tok is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt",
                               code="no_tokenizer")
            out.append(Prompt(item, list(tok.encode(item))))
        else:
            out.append(Prompt(None, [int(t) for t in item]))
    return out


def _check_lengths(prompts: list[Prompt], max_tokens: int, drop_generated: bool, max_len: int | None,
                   chat: bool) -> None:
    where = "messages" if chat else "prompt"
    for i, prompt in enumerate(prompts):
        ids = prompt.token_ids
        if not ids:
            raise APIError(400, "the prompt is empty", param=where, code="empty_prompt")
        if max_len is not None:
            need = len(ids) + (0 if drop_generated else max_tokens)
            if len(ids) >= max_len or need > max_len:
                raise APIError(
                    400,
                    f"this model's maximum context length is {max_len} tokens; the request asks for {need} "
                    f"({len(ids)} in the {where}{'' if len(prompts) == 1 else f' {i}'}, {max_tokens} to generate)",
                    param=where, code="context_length_exceeded")


def _sampling_values(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The request's SamplingParams fields that it sets (max_tokens and logprobs apart: per endpoint)."""
    values: dict[str, Any] = {}
    for name in _SAMPLING_FIELDS:
        v = getattr(body, name)
        if v is not None:
            values[name] = v
    if body.stop is not None:
        values["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if body.stop_token_ids is not None:
        values["stop_token_ids"] = tuple(body.stop_token_ids)
    return values


_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")


def _structured_spec(body: CompletionRequest | ChatCompletionRequest):
    """The request's structured-output constraint (a StructuredSpec) or None; a 400 naming the field."""
    rf = body.response_format.model_dump(exclude_none=True) if body.response_format is not None else None
    try:
        return spec_from_request(response_format=rf, structured_outputs=body.structured_outputs,
                                 guided_json=body.guided_json, guided_regex=body.guided_regex,
                                 guided_choice=body.guided_choice, guided_grammar=body.guided_grammar)
    except GrammarError as err:
        text = str(err)
        param = next((f for f in _STRUCTURED_FIELDS if text.startswith(f)), None)
        if param is None:  # the message names the kind (json_schema, regex, ...): name the field sent
            param = next((f for f in _STRUCTURED_FIELDS if getattr(body, f) is not None), None)
        raise APIError(400, text, param=param, code="invalid_structured_output") from None


def _sampling_params(values: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**values)
    except RequestError as err:  # its message starts with the field it names
        param = next((name for name in values if str(err).startswith(name)), None)
        raise APIError(400, str(err), param=param, code="invalid_sampling_params") from None
    except (TypeError, ValueError) as err:
        raise APIError(400, f"invalid sampling parameters: {err}", code="invalid_sampling_params") from None
