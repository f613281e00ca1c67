"""Request translation: an OpenAI request body -> checked `EngineRequest`s (one per prompt) and one `SamplingParams`.

Here a request gets the model's generation defaults for the fields it leaves unset, its `max_tokens`
default (per endpoint, as vLLM's), and the 400s of the body itself (tools, structured output, sampling
values `SamplingParams` refuses). Its prompts go through the engine's processor
(`jaxserve.engine.processor`): chat messages rendered with the chat template, prompts tokenized, and
every request check (empty prompt, context length, token ids, pages, features) made there once, with
the messages `LLM.generate` raises; a refusal is a 400 naming the field and the rule.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import TYPE_CHECKING, Any

from jaxserve.engine.processor import EngineRequest, Prompt, PromptError
from jaxserve.errors import RequestError
from jaxserve.kv_transfer.disagg import check_params as check_kv_transfer_params
from jaxserve.lora.request import LoRARequest
from jaxserve.sampling.fields import FIELDS
from jaxserve.sampling.params import SamplingParams
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
class GenerationRequest:
    """What one HTTP request asks the engine for: every prompt with the same params (`params.n` samples each)."""

    chat: bool
    requests: list[EngineRequest]  # one per prompt, ids f"{request_id}-{index}", checked by the processor
    params: SamplingParams
    echo: bool = False  # completions: the prompt's text (and logprobs) before each choice's text
    drop_generated: bool = False  # completions with max_tokens 0: echo only, the one generated token dropped
    n_logprobs: int | None = None  # top-N logprobs per output token in the response, None: none asked
    tools: ToolPlan | None = None  # chat with tools: what parses the output into tool_calls
    reasoning: ReasoningParser | None = None  # chat under --reasoning-parser: splits reasoning from content
    reasoning_open: bool = True  # the output starts in reasoning (False: the prompt closed the think block)
    lora_request: LoRARequest | None = None  # the adapter the request's model names (None: the base model)
    request_id: str = ""  # the response's id (chatcmpl-..., cmpl-...)

    @property
    def prompts(self) -> list[Prompt]:
        return [Prompt(r.prompt_token_ids, r.prompt) for r in self.requests]


def translate(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    chat: bool,
    request_id: str | None = None,
    lora_request: LoRARequest | None = None,
) -> GenerationRequest:
    """The body as checked engine requests (`request_id`: the response's id, made here when None;
    `lora_request`: the adapter the body's model names). Every refusal is an APIError (400)."""
    processor = state.engine.processor
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
    where = "messages" if chat else "prompt"

    if chat:
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.options.tool_call_parser)
        if tools.spec is not None:
            if structured is not None:
                field = next(f for f in _STRUCTURED_FIELDS if getattr(body, f) is not None)
                raise APIError(
                    400,
                    f"tool_choice {tools.choice!r} constrains the output to tool calls, and {field} "
                    "constrains it too; send one of them",
                    param="tool_choice",
                    code="invalid_tools",
                )
            values["structured"] = tools.spec
        prompts = [chat_prompt(state, body, tools.tools)]
        if state.options.reasoning_parser is not None:
            reasoning = get_reasoning_parser(state.options.reasoning_parser)
            reasoning_open = not reasoning.reasoning_in_prompt_closed(prompts[0].text)
            if reasoning_open and values.get("structured") is not None:  # the grammar applies to the answer
                values["structured"] = values["structured"].after_reasoning(reasoning.end)
        max_tokens = body.max_tokens or body.max_completion_tokens
        if max_tokens is None:  # as vLLM: the model's max_new_tokens, at most what is left of the context
            max_tokens = min(v for v in (defaults.get("max_tokens"), processor.room(prompts[0])) if v is not None)
        values["max_tokens"] = max_tokens
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

    params = _sampling_params(values)
    rid = request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    requests = []
    for i, prompt in enumerate(prompts):  # every prompt checked before any is submitted
        try:
            requests.append(processor.process(f"{rid}-{i}", prompt, params, lora_request=lora_request))
        except PromptError as err:
            raise _refusal(err, where) from None
    return GenerationRequest(
        chat, requests, params, echo, drop_generated, n_logprobs, tools, reasoning, reasoning_open, lora_request, rid
    )


def chat_prompt(
    state: ServerState, body: ChatCompletionRequest | TokenizeRequest, tools: list[dict[str, Any]] | None = None
) -> Prompt:
    """The body's messages (and tools) as a prompt, rendered with the server's chat template by the
    processor, as LLM.chat renders them (a 400 when the template refuses them). `tools`: already
    checked; else the body's are checked here."""
    messages = template_messages(body.messages)
    if tools is None and body.tools:
        tools = normalize_tools(body.tools)
    add_gen = body.add_generation_prompt
    if add_gen is None:
        add_gen = not body.continue_final_message
    try:
        return state.engine.processor.chat_prompt(
            messages,
            state.chat,
            add_generation_prompt=add_gen,
            continue_final_message=bool(body.continue_final_message),
            tools=tools,
            documents=body.documents,
            chat_template_kwargs=body.chat_template_kwargs,
        )
    except PromptError as err:
        raise _refusal(err, "messages") from None


def render_chat(
    state: ServerState, body: ChatCompletionRequest | TokenizeRequest, tools: list[dict[str, Any]] | None = None
) -> str:
    """The body's messages as prompt text (/tokenize)."""
    return chat_prompt(state, body, tools).text


def _refusal(err: PromptError, where: str) -> APIError:
    return APIError(400, str(err), param=where, code=err.code)


def _completion_prompts(state: ServerState, body: CompletionRequest) -> list[Prompt]:
    """`prompt` as a string, strings, token ids or lists of token ids: one Prompt each."""
    p = body.prompt
    if isinstance(p, str):
        items: list = [p]
    elif isinstance(p[0], str):
        items = list(p)
    elif isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    processor = state.engine.processor
    try:
        return [processor.prompt(item) if isinstance(item, str) else processor.prompt(token_ids=item) for item in items]
    except PromptError as err:
        raise _refusal(err, "prompt") from None


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
    if body.kv_transfer_params is not None:
        try:
            values["kv_transfer_params"] = check_kv_transfer_params(body.kv_transfer_params)
        except RequestError as err:
            raise APIError(400, str(err), param="kv_transfer_params", code="invalid_kv_transfer_params") from None
    return values


_STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def _structured_spec(body: CompletionRequest | ChatCompletionRequest):
    """The request's structured-output constraint (a StructuredSpec) or None; a 400 naming the field."""
    rf = body.response_format.model_dump(exclude_none=True) if body.response_format is not None else None
    try:
        return spec_from_request(
            response_format=rf,
            structured_outputs=body.structured_outputs,
            guided_json=body.guided_json,
            guided_regex=body.guided_regex,
            guided_choice=body.guided_choice,
            guided_grammar=body.guided_grammar,
        )
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
