"""The server's errors: `APIError`, OpenAI's error object, and engine exceptions mapped to HTTP statuses."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.responses import JSONResponse

from jaxserve.errors import JaxServeError, LoRAError, LoRANotFoundError, RequestError
from jaxserve.structured.errors import GrammarError

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    405: "invalid_request_error",
    503: "service_unavailable",
    500: "internal_error",
}


class APIError(Exception):
    """Answered as `{"error": {...}}` with `status` (before a stream starts) or as an in-band SSE error event."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def dumps(obj: Any) -> str:
    """Compact JSON, non-ASCII kept (error bodies and SSE events). Strict, as JSONResponse is: a float
    that is not finite raises ValueError (no `Infinity`/`NaN`, which JSON has not) rather than sending
    what a client's parser refuses; the responses' numbers are made finite where they are produced."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def error_body(
    status: int, message: str, type: str | None = None, param: str | None = None, code: str | int | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": type or _ERROR_TYPES.get(status, "error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def error_response(status: int, message: str, **kw: Any) -> JSONResponse:
    return JSONResponse(error_body(status, message, **kw), status_code=status)


def engine_error(err: BaseException) -> APIError:
    """What an exception from the engine means for the client: its request is bad (400), the engine cannot
    take requests (503), or something failed while processing it (500, logged)."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, GrammarError):  # the grammar library refused the request's schema, regex or grammar
        return APIError(400, str(err), code="invalid_structured_output")
    if isinstance(err, LoRANotFoundError):  # its adapter was unloaded between the name check and the engine
        return APIError(404, str(err), type="not_found_error", param="model", code="model_not_found")
    if isinstance(err, LoRAError):
        return APIError(400, str(err), code="invalid_lora_adapter")
    if isinstance(err, RequestError):
        return APIError(400, str(err), code="invalid_request")
    if isinstance(err, JaxServeError):
        return APIError(
            503, f"the engine cannot take this request: {err}", type="service_unavailable", code="engine_unavailable"
        )
    logger.error("request failed inside the engine", exc_info=(type(err), err, err.__traceback__))
    return APIError(
        500,
        f"internal error while processing this request: {type(err).__name__}: {err}",
        type="internal_error",
        code="internal_error",
    )
