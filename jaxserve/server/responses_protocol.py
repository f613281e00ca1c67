"""Request and response schemas of `POST /v1/responses` (OpenAI's Responses API), pydantic 2.

As in `protocol.py`: a `null` counts as absent, and a field jaxserve does not know or does not
implement is a 400 that names it (error type "unsupported_field"), never silently ignored. Those
OpenAI defines but jaxserve does not serve are listed in `RESPONSES_UNSUPPORTED` with the reason the
error gives. `input` items, `tools`, `tool_choice` and `text.format` are typed loosely here and checked
item by item in `responses.py`, whose 400s name the item (`input[2].content[0].type`), as the chat
route's tools are checked in `tools.py`.

The response models at the end document the shapes in the OpenAPI schema; the server builds plain
dicts of these shapes (the `openai` client's `Response` and `ResponseStreamEvent` types read them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Field, create_model, model_validator

from jaxserve.sampling.fields import BY_NAME
from jaxserve.server.protocol import OpenAIBase, _request_field, unsupported

MAX_INPUT_ITEMS = 2048
MAX_TOOLS = 128

# OpenAI fields that jaxserve knowingly does not serve: the 400 says why.
RESPONSES_UNSUPPORTED = {
    "conversation": "conversations are not supported; continue with previous_response_id or send the whole input",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "max_tool_calls": "max_tool_calls is not supported (only function tools, which the client runs)",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
    "prompt_cache_key": "prompt_cache_key is not supported (prefix caching is automatic)",
    "prompt_cache_retention": "prompt cache retention is not supported (prefix caching is automatic)",
    "prompt_cache_options": "prompt cache options are not supported (prefix caching is automatic)",
    "context_management": "context management (compaction) is not supported",
    "moderation": "moderation is not supported",
    "image": "image options are not supported: there is no image input or output",
    "access_programs": "access programs are not supported",
    "background_options": "background responses are not supported",
    "service_tier": "service_tier is not supported",
    "stream_options": "stream_options are not supported on /v1/responses",
}

# The sampling fields of the table that /v1/responses takes besides OpenAI's temperature and top_p (vLLM's extras).
RESPONSES_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


class ResponsesBase(OpenAIBase):
    """OpenAIBase, with this route's reasons for the OpenAI fields it refuses."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_absent_unknown_rejected(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}
        for key in data:
            if key not in cls.model_fields:
                raise unsupported(str(key), RESPONSES_UNSUPPORTED.get(str(key)))
        return data


_ResponsesSampling = create_model(
    "_ResponsesSampling", __base__=ResponsesBase, **{name: _request_field(BY_NAME[name]) for name in RESPONSES_SAMPLING}
)


class ResponsesRequest(_ResponsesSampling):
    model: Optional[str] = Field(None, description="a served model name (GET /v1/models); default: the served model")
    input: Union[str, Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)]] = Field(
        ...,
        description="a user message, or a list of items: messages (role user, system, developer or assistant; "
        "content a string or input_text / output_text parts), function_call, function_call_output, "
        "reasoning (not rendered: templates drop earlier turns' reasoning)",
    )
    instructions: Optional[str] = Field(
        None, description="a system message before the input (not carried over by previous_response_id)"
    )
    max_output_tokens: Optional[int] = Field(None, ge=1, description="default: what is left of max_model_len")
    tools: Optional[Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)]] = Field(
        None,
        description='function tools only: [{"type": "function", "name", "description", "parameters", '
        '"strict"}]; built-in tools (web_search, file_search, computer use, ...) are refused',
    )
    tool_choice: Optional[Union[str, dict[str, Any]]] = Field(
        None, description='"none", "auto" (the default with tools), "required", or {"type": "function", "name"}'
    )
    parallel_tool_calls: Optional[bool] = Field(None, description="default true: more than one call per turn")
    text: Optional[dict[str, Any]] = Field(
        None,
        description='{"format": {"type": "text"} | {"type": "json_object"} | '
        '{"type": "json_schema", "name", "schema", "strict"}}: structured output, as '
        "chat's response_format",
    )
    reasoning: Optional[dict[str, Any]] = Field(
        None,
        description="only empty: reasoning items come from the server's --reasoning-parser; effort and summary "
        "are refused",
    )
    store: Optional[bool] = Field(
        None,
        description="default true (unless the server runs --no-responses-store): "
        "keep the response for GET and previous_response_id",
    )
    previous_response_id: Optional[str] = Field(None, description="continue the conversation of a stored response")
    stream: Optional[bool] = None
    metadata: Optional[Annotated[dict[str, str], Field(max_length=16)]] = Field(
        None, description="up to 16 string pairs, returned with the response"
    )
    user: Optional[str] = Field(None, description="an end-user id; recorded, not used")
    safety_identifier: Optional[str] = Field(None, description="an end-user id; recorded, not used")
    background: Optional[bool] = Field(None, description="only false: background responses are not supported")
    truncation: Optional[Literal["disabled", "auto"]] = Field(
        None, description='only "disabled" (the default): a prompt over the context is a 400'
    )
    include: Optional[Annotated[list[str], Field(max_length=16)]] = Field(
        None, description="only empty: no extra output data (logprobs, encrypted reasoning) is supported"
    )

    @model_validator(mode="after")
    def _refusals(self):
        refused = {
            "background": ("background responses are not supported" if self.background else None),
            "truncation": (
                "truncation 'auto' is not supported: a prompt over the context is a 400"
                if self.truncation == "auto"
                else None
            ),
            "include": (f"include {self.include[0]!r} is not supported" if self.include else None),
            "reasoning": (
                "reasoning options (effort, summary) are not supported: reasoning items come from the "
                "server's --reasoning-parser"
                if any(v is not None for v in (self.reasoning or {}).values())
                else None
            ),
        }
        for field, reason in refused.items():
            if reason is not None:
                raise unsupported(field, reason)
        return self


# ---- responses (documentation of the shapes; the server builds plain dicts of these shapes) ----------


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens, cache_write_tokens (both 0: not reported)
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens
    total_tokens: int


class ResponseObject(BaseModel):
    id: str  # "resp_..."
    object: Literal["response"] = "response"
    created_at: float
    completed_at: Optional[float] = None
    model: str
    status: Literal["completed", "incomplete", "failed", "in_progress", "cancelled"]
    incomplete_details: Optional[dict[str, Any]] = None  # {"reason": "max_output_tokens"}
    error: Optional[dict[str, Any]] = None  # {"code", "message"} when failed
    # items: {"type": "reasoning" | "message" | "function_call", "id", "status", ...}
    output: list[dict[str, Any]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool
    previous_response_id: Optional[str] = None
    store: bool
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: dict[str, Any]
    tool_choice: Union[str, dict[str, Any]]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


__all__ = ["RESPONSES_UNSUPPORTED", "DeletedResponse", "ResponseObject", "ResponsesRequest"]
