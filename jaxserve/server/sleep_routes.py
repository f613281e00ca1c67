"""The routes a trainer in another process drives the server with (docs/training_loop.md), under
vLLM's and SGLang's names and answers; they answer 404 unless the engine was started with
`--enable-sleep-mode` (vLLM's flag), since any client that reaches them can stop the server.

  POST /sleep?level=1|2          vLLM's: level 1 weights to host memory, 2 discarded; the KV cache
                                 discarded; requests held are aborted, new ones get 503 until woken
  POST /wake_up[?tags=weights&tags=kv_cache]   all, or the parts named
  GET  /is_sleeping              {"is_sleeping": bool}
  POST /pause?mode=abort|wait|keep   vLLM's pause_generation: {"status": "paused"}; new requests wait
  POST /resume                   {"status": "resumed"}
  GET  /is_paused                {"is_paused": bool}
  POST /update_weights_from_disk SGLang's body {"model_path", "load_format", "abort_all_requests",
                                 "weight_version"}: {"success", "message", "num_paused_requests"}
  GET  /get_weight_version       SGLang's: {"weight_version": ...}

A bad level, mode or tag is a 400; a checkpoint that does not fit the model a 400 with SGLang's
`{"success": false, "message": ...}`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from jaxserve.errors import JaxServeError, RequestError
from jaxserve.server.errors import APIError, engine_error
from jaxserve.server.protocol import ErrorResponse

if TYPE_CHECKING:
    from jaxserve.server.state import ServerState

logger = logging.getLogger(__name__)

# What these routes answer besides 200 and FastAPI's 422: a bad level, mode, tag or checkpoint (400),
# sleep mode off (404), the engine loading or asleep (503).
ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 503)}

SLEEP_ROUTES = (
    "POST /sleep",
    "POST /wake_up",
    "GET /is_sleeping",
    "POST /pause",
    "POST /resume",
    "GET /is_paused",
    "POST /update_weights_from_disk",
    "GET /get_weight_version",
)


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's body of POST /update_weights_from_disk (its other fields are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore")

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


def add_sleep_routes(app: FastAPI, state: ServerState) -> None:
    def engine():
        """The engine, if it serves sleep mode (else 404, as vLLM without its flag)."""
        state.check_ready()
        eng = state.engine
        if not getattr(getattr(eng, "config", None), "enable_sleep_mode", False) or not hasattr(eng, "sleep"):
            raise APIError(
                404,
                "sleep mode is off: start the server with --enable-sleep-mode",
                type="not_found_error",
                code="sleep_mode_off",
            )
        return eng

    async def run(call) -> None:
        try:
            await call
        except JaxServeError as err:
            raise engine_error(err) from None

    @app.post("/sleep", responses=ERRORS)
    async def sleep(level: int = 1):
        await run(engine().sleep(level))
        return Response(status_code=200)

    @app.post("/wake_up", responses=ERRORS)
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None):
        await run(engine().wake_up(tags))
        return Response(status_code=200)

    @app.get("/is_sleeping", responses=ERRORS)
    async def is_sleeping():
        return {"is_sleeping": await engine().is_sleeping()}

    @app.post("/pause", responses=ERRORS)
    async def pause(mode: str = "abort"):
        await run(engine().pause(mode))
        return {"status": "paused"}

    @app.post("/resume", responses=ERRORS)
    async def resume():
        await run(engine().resume())
        return {"status": "resumed"}

    @app.get("/is_paused", responses=ERRORS)
    async def is_paused():
        return {"is_paused": await engine().is_paused()}

    @app.post("/update_weights_from_disk", responses=ERRORS)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
        eng = engine()
        try:
            report, aborted = await eng.update_weights_from_disk(
                body.model_path, body.load_format, body.weight_version, abort_all_requests=body.abort_all_requests
            )
        except (RequestError, JaxServeError, OSError) as err:
            logger.warning("update_weights_from_disk(%s) failed: %s", body.model_path, err)
            return JSONResponse({"success": False, "message": str(err), "num_paused_requests": 0}, status_code=400)
        message = (
            f"Succeeded to update model weights: {report.tensors} tensors in {report.seconds * 1e3:.1f} ms, "
            f"weight_version {report.weight_version}"
        )
        return {"success": True, "message": message, "num_paused_requests": aborted}

    @app.get("/get_weight_version", responses={503: {"model": ErrorResponse}})
    async def get_weight_version():
        state.check_ready()  # no flag needed: reading the version changes nothing
        return {"weight_version": getattr(state.engine, "weight_version", None)}
