"""POST /v1/embeddings (OpenAI's Embeddings API) over a pooling engine (`--runner pooling`).

`input` is a string, a list of strings, a list of token ids or a list of such lists (OpenAI's four
forms); each becomes one prompt, embedded by `engine/pooling.py` beside the others in the same
steps. `encoding_format` float (a JSON list) or base64 (the float32 bytes, little-endian: what the
official `openai` client asks for by default and decodes with NumPy); `dimensions` cuts a
Matryoshka model's embedding before it is normalized; `user` is accepted and logged. Usage counts the
prompt tokens. Whatever the engine would refuse (empty input, a prompt past the context length, ids
outside the vocabulary, dimensions the model cannot give) is a 400 naming the input and the problem,
before anything is queued. A server started for generation answers with a 400 that says how to
start one for embeddings, as vLLM does ("does not support Embeddings API").
"""

from __future__ import annotations

import base64
import logging
import sys
import uuid
from typing import Any, Literal, Optional, Union

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictInt, StrictStr

from jaxserve.errors import RequestError
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import OpenAIBase
from jaxserve.server.state import ServerState

logger = logging.getLogger(__name__)

EMBEDDINGS_ROUTE = "/v1/embeddings"
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of inputs per request

TokenIds = list[StrictInt]


class EmbeddingRequest(OpenAIBase):
    model: Optional[str] = None
    input: Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]] = Field(
        ..., description="a string, a list of strings, a list of token ids, or a list of token id lists"
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: JSON numbers; base64: float32 bytes"
    )
    dimensions: Optional[StrictInt] = Field(None, description="output size (Matryoshka models only)")
    user: Optional[str] = None
    add_special_tokens: bool = Field(True, description="vLLM's: the tokenizer's special tokens added to texts")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], str]
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def check_pooling(state: ServerState) -> Any:
    """The server's engine if it pools; a 400 saying how to serve embeddings otherwise."""
    engine = state.engine
    if not getattr(engine, "pooling", False):
        raise APIError(
            400,
            "this server runs a text generation model, which does not support the Embeddings API: "
            "start jaxserve serve with --runner pooling (--convert embed) to serve /v1/embeddings",
            param="model",
            code="embeddings_not_supported",
        )
    return engine


def refuse_generation(state: ServerState) -> None:
    """Generation routes on a pooling server: a 400 naming the route it serves."""
    if getattr(state.engine, "pooling", False):
        raise APIError(
            400,
            "this server runs a pooling model (--runner pooling): it serves POST /v1/embeddings only; "
            "start jaxserve serve without --runner pooling to generate text",
            code="generation_not_supported",
        )


def prompts_of(body: EmbeddingRequest, tokenizer: Any) -> list[list[int]]:
    """Each input as token ids (texts tokenized here); 400s for the request's shape."""
    raw = body.input
    if isinstance(raw, str):
        items: list = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [raw]  # one prompt of token ids
    else:
        items = list(raw)
    if not items:
        raise APIError(400, "input is empty: give a string, a list of strings or token ids", param="input")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise APIError(400, f"input has {len(items)} items; at most {MAX_EMBEDDING_INPUTS} a request", param="input")
    prompts = []
    for i, item in enumerate(items):
        where = "input" if len(items) == 1 else f"input[{i}]"
        if isinstance(item, str):
            if tokenizer is None:
                raise APIError(400, f"{where}: this model has no tokenizer; give token ids", param="input")
            if not item:
                raise APIError(400, f"{where} is an empty string", param="input")
            item = tokenizer.encode(item, add_special_tokens=body.add_special_tokens)
        prompts.append([int(t) for t in item])
    return prompts


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        data = np.asarray(vector, "<f4").tobytes() if sys.byteorder == "little" else vector.astype("<f4").tobytes()
        return base64.b64encode(data).decode("ascii")
    return vector.tolist()


async def create_embeddings(state: ServerState, body: EmbeddingRequest) -> JSONResponse:
    state.check_ready()
    engine = check_pooling(state)
    model, adapter = state.check_model(body.model)
    if adapter is not None:
        raise APIError(400, "LoRA adapters are not served for embeddings", param="model")
    prompts = prompts_of(body, state.tokenizer)
    for i, ids in enumerate(prompts):
        try:
            engine.check_prompt(ids, body.dimensions)
        except ValueError as err:
            where = "input" if len(prompts) == 1 else f"input[{i}]"
            param = "dimensions" if "dimensions" in str(err) else "input"
            raise APIError(400, f"{where}: {err}" if param == "input" else str(err), param=param) from None
    await state.check_queue()
    if body.user:
        logger.debug("embeddings for user %r", body.user)
    base = f"embd-{uuid.uuid4().hex}"
    try:
        outputs = await engine.embed_many([f"{base}-{i}" for i in range(len(prompts))], prompts, body.dimensions)
    except RequestError as err:
        raise APIError(400, str(err), param="input") from None
    data = [
        {"object": "embedding", "embedding": encode(out.outputs.data, body.encoding_format), "index": i}
        for i, out in enumerate(outputs)
    ]
    tokens = sum(len(ids) for ids in prompts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse({"object": "list", "data": data, "model": model, "usage": usage})


def add_embeddings_routes(app: FastAPI, state: ServerState, err_responses: dict) -> None:
    @app.post(EMBEDDINGS_ROUTE, response_model=EmbeddingResponse, responses=err_responses)
    async def embeddings(body: EmbeddingRequest):
        return await create_embeddings(state, body)
