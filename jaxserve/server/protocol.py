"""Request and response schemas of the OpenAI-compatible API (pydantic 2).

Conventions:
- A field sent as `null` counts as absent (many clients send every field), at every nesting level.
- A field the schema does not know is rejected with a 400 that names it (error type
  "unsupported_field"), never silently ignored; that includes OpenAI fields jaxserve does not
  implement yet (`suffix`, `functions`, ...).
- Tools (`tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls`) are typed loosely here
  and checked by `jaxserve.server.tools` in `requests.translate` (a 400 naming the field).
- Structured output (`response_format`, vLLM's `structured_outputs` and `guided_*`) is typed loosely
  here and checked by `jaxserve.structured.spec_from_request` in `requests.translate`, whose
  GrammarError names the problem (a 400); the grammar library's own refusals come from the engine.
- Types and ranges that the schema states (e.g. `temperature` in [0, 2]) fail with 400 (as OpenAI and
  vLLM answer them, not FastAPI's 422; code "validation_error"). Those of the
  plain sampling fields (temperature, top_p, n, seed, ...) come from `jaxserve.sampling.fields`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from jaxserve.sampling import fields as sampling_fields
from jaxserve.sampling.fields import FIELDS, MAX_LOGPROBS, SamplingField

MAX_N = sampling_fields.MAX_N  # the table bounds n by it; GET /v1/capabilities reports it
MAX_PROMPTS = 64
MAX_STOP = 16

# Fields of the OpenAI API (or vLLM's extras) that jaxserve knowingly does not implement; the error
# names them as such rather than as unknown.
KNOWN_UNSUPPORTED = {
    "tools": "tools are taken by /v1/chat/completions only",
    "tool_choice": "tools are taken by /v1/chat/completions only",
    "parallel_tool_calls": "tools are taken by /v1/chat/completions only",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "suffix": "suffix (insertion) is not supported",
    "best_of": "best_of is not supported; use n",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "store": "stored completions are not supported",
    "metadata": "stored completions are not supported",
    "service_tier": "service_tier is not supported",
    "reasoning_effort": "reasoning_effort is not supported",
    "web_search_options": "web search is not supported",
    "refusal": "refusal in messages is not supported",
}


def unsupported(field: str, reason: str | None = None) -> PydanticCustomError:
    reason = reason or KNOWN_UNSUPPORTED.get(field) or "unknown field"
    return PydanticCustomError(
        "unsupported_field",
        "unsupported parameter '{field}': {reason}",
        {"field": field, "reason": reason},
    )


class OpenAIBase(BaseModel):
    """Nulls count as absent; unknown fields are rejected by name."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_absent_unknown_rejected(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}
        for key in data:
            if key not in cls.model_fields:
                raise unsupported(str(key))
        return data


NonNegInt = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1)]
StopField = Optional[Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP)]]]


class StreamOptions(OpenAIBase):
    include_usage: Optional[bool] = Field(None, description="send a last chunk with the usage of the whole request")


class ResponseFormat(OpenAIBase):
    """OpenAI's response_format: text, json_object, or json_schema with {"name", "schema", "strict"}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None


def _request_field(field: SamplingField) -> tuple[Any, Any]:
    """A table field as a pydantic field: absent (None) by default, its bounds (the API's upper bound
    where it has a stricter one) stated in the schema, so a value outside them is a 400."""
    le = field.api_le if field.api_le is not None else field.le
    return (
        Optional[field.type],
        Field(None, ge=field.ge, gt=field.gt, le=le, lt=field.lt, description=field.api_description()),
    )


# The sampling fields the table describes and the API takes as they are.
_TableSamplingFields = create_model(
    "_TableSamplingFields", __base__=OpenAIBase, **{f.name: _request_field(f) for f in FIELDS if f.request}
)


class SamplingFields(_TableSamplingFields):
    """Fields shared by completions and chat completions: the table's, and those with their own types."""

    model: Optional[str] = Field(None, description="a served model name (GET /v1/models); default: the served model")
    stop: StopField = Field(None, description="stop strings, cut from the returned text")
    stop_token_ids: Optional[Annotated[list[NonNegInt], Field(max_length=64)]] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, description="an end-user id; recorded, not used")
    logit_bias: Optional[dict[str, float]] = Field(
        None, description="token id (a string key) -> bias in [-100, 100] added to its logit; at most 300 entries"
    )
    # Structured output (one of them per request): OpenAI's response_format, vLLM's structured_outputs
    # and its older guided_* aliases.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = Field(
        None, description="vLLM's: one of json (a schema), regex, choice, grammar (Lark or GBNF), json_object"
    )
    guided_json: Optional[Union[dict[str, Any], str, bool]] = Field(None, description="a JSON schema")
    guided_regex: Optional[str] = Field(
        None, description="the whole output matches this regex (no look-around, no backreferences)"
    )
    guided_choice: Optional[list[str]] = Field(None, description="the output is exactly one of these strings")
    guided_grammar: Optional[str] = Field(None, description="a Lark or GBNF grammar")
    kv_transfer_params: Optional[dict[str, Any]] = Field(
        None,
        description="vLLM's: a P/D proxy's handle on KV pages (docs/disaggregation.md); passed to the KV connector",
    )

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "invalid_combination", "stream_options is only allowed when stream is true", {"field": "stream_options"}
            )
        return self


PromptField = Union[
    str,
    Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)],
    Annotated[list[NonNegInt], Field(min_length=1)],
    Annotated[list[Annotated[list[NonNegInt], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)],
]


class CompletionRequest(SamplingFields):
    prompt: PromptField = Field(..., description="a string, a list of strings, token ids, or a list of token-id lists")
    max_tokens: Optional[int] = Field(None, ge=0, description="default 16; 0 only with echo (prompt logprobs only)")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="log-probabilities of the top N tokens")
    echo: Optional[bool] = Field(None, description="prepend the prompt to the completion")

    @model_validator(mode="after")
    def _max_tokens_zero_needs_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError(
                "invalid_combination", "max_tokens=0 is only allowed with echo=true", {"field": "max_tokens"}
            )
        return self


class ContentPart(OpenAIBase):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "text"):
            raise unsupported("content", f"content parts of type {data.get('type')!r} are not supported (only 'text')")
        return data


class ChatMessage(OpenAIBase):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[Annotated[list[dict[str, Any]], Field(max_length=128)]] = Field(
        None,
        description='assistant: the calls it made, [{"id", "type": "function", "function": {"name", '
        '"arguments": a JSON string}}]',
    )
    tool_call_id: Optional[str] = Field(None, description="tool: the id of the call this message answers")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[int] = Field(None, ge=1, description="default: what is left of max_model_len")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="same as max_tokens")
    logprobs: Optional[bool] = Field(None, description="return log-probabilities of the output tokens")
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: Optional[bool] = Field(None, description="default true")
    continue_final_message: Optional[bool] = Field(None, description="continue the last (assistant) message")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description='extra variables for the chat template, e.g. {"enable_thinking": false}'
    )
    documents: Optional[Annotated[list[dict[str, Any]], Field(max_length=64)]] = Field(
        None, description="documents for retrieval-augmented templates (the template's `documents` variable)"
    )
    tools: Optional[Annotated[list[dict[str, Any]], Field(max_length=128)]] = Field(
        None,
        description='[{"type": "function", "function": {"name", "description", "parameters", '
        '"strict"}}], rendered by the chat template',
    )
    tool_choice: Optional[Union[str, dict[str, Any]]] = Field(
        None,
        description='"none", "auto" (the default with tools), "required", or '
        '{"type": "function", "function": {"name"}}',
    )
    parallel_tool_calls: Optional[bool] = Field(None, description="default true: more than one call per turn")

    @model_validator(mode="after")
    def _checks(self):
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise PydanticCustomError(
                "invalid_combination",
                "give max_tokens or max_completion_tokens, not both",
                {"field": "max_completion_tokens"},
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError(
                "invalid_combination", "top_logprobs needs logprobs=true", {"field": "top_logprobs"}
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise PydanticCustomError(
                "invalid_combination",
                "continue_final_message and add_generation_prompt cannot both be true",
                {"field": "continue_final_message"},
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise PydanticCustomError(
                "invalid_combination",
                "continue_final_message needs the last message to be from the assistant",
                {"field": "continue_final_message"},
            )
        return self


class TokenizeRequest(OpenAIBase):
    """vLLM's POST /tokenize: a `prompt`, or chat `messages` rendered with the server's chat template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    add_special_tokens: Optional[bool] = Field(None, description="default: true for a prompt, false for messages")
    add_generation_prompt: Optional[bool] = Field(None, description="messages: default true")
    continue_final_message: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    documents: Optional[Annotated[list[dict[str, Any]], Field(max_length=64)]] = None
    tools: Optional[Annotated[list[dict[str, Any]], Field(max_length=128)]] = Field(
        None, description="messages: tools for the chat template, as chat completions takes them"
    )
    return_token_strs: Optional[bool] = Field(None, description="also return each token's string")

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError(
                "invalid_combination", "give exactly one of prompt or messages", {"field": "prompt"}
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise PydanticCustomError(
                "invalid_combination",
                "continue_final_message and add_generation_prompt cannot both be true",
                {"field": "continue_final_message"},
            )
        return self


class DetokenizeRequest(OpenAIBase):
    """vLLM's POST /detokenize."""

    model: Optional[str] = None
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: Optional[int] = None
    tokens: list[int]
    token_strs: Optional[list[Optional[str]]] = None


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- responses (documentation of the shapes; the server builds plain dicts of these shapes) -------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length", "abort"]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    kv_transfer_params: Optional[dict[str, Any]] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str  # "call_..."
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]  # None when the reply is only tool calls
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[Literal["stop", "length", "abort", "tool_calls"]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None
    kv_transfer_params: Optional[dict[str, Any]] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxserve"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model (its served name); None for a base model
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
