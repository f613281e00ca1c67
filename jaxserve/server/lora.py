"""LoRA adapters on the server, as vLLM serves them (docs/lora.md, "Serving adapters").

A request's `model` naming a loaded adapter runs with it (`ServerState.check_model` asks `ServerLoRA.lookup`);
`/v1/models` lists one card per adapter (`id` its name, `root` its path, `parent` the base model's served
name); with runtime updating allowed (`--allow-runtime-lora-updating`, or vLLM's environment variable
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`/`true`) two routes load and unload adapters while serving, with
vLLM's bodies and answers:

  POST /v1/load_lora_adapter    {"lora_name", "lora_path", "load_inplace": false}
  POST /v1/unload_lora_adapter  {"lora_name"} (or vLLM's {"lora_int_id"})
  200  text/plain "Success: LoRA adapter 'NAME' added successfully." (or "... removed successfully.")
  400  a bad body; LoRA not enabled (--enable-lora); a name already loaded (without load_inplace) or
       taken by the base model; an adapter the engine refuses (its LoRAError: a missing file, a rank
       above --max-lora-rank, a module it cannot adapt, ...)
  404  unloading an adapter that is not loaded; both routes when runtime updating is off (they are
       not registered, as in vLLM)

The adapters are the engine's (`engine.list_loras()`, read each time), so adapters loaded at start
(`--lora-modules`) and at run time look the same. Nothing here holds a copy that could go stale.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any, Optional

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import StrictBool

from jaxserve.errors import LoRAError, LoRANotFoundError
from jaxserve.lora.request import LoRARequest
from jaxserve.server.errors import APIError, engine_error
from jaxserve.server.protocol import OpenAIBase

if TYPE_CHECKING:
    from jaxserve.server.state import ServerState

logger = logging.getLogger(__name__)

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def runtime_updating_allowed(option: bool | None, environ: Any = None) -> bool:
    """`--allow-runtime-lora-updating` if given (True/False), else vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`
    read as vLLM reads it: "1" or "true" (any case) is on, anything else off."""
    if option is not None:
        return bool(option)
    value = (os.environ if environ is None else environ).get(RUNTIME_UPDATING_ENV, "0")
    return value.strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(OpenAIBase):
    """vLLM's body of POST /v1/load_lora_adapter."""

    lora_name: Optional[str] = None
    lora_path: Optional[str] = None
    load_inplace: Optional[StrictBool] = None  # replace an adapter of that name (new weights, same name)
    is_3d_lora_weight: Optional[StrictBool] = None  # vLLM's MoE adapters stored in 3D: refused when true


class UnloadLoRAAdapterRequest(OpenAIBase):
    """vLLM's body of POST /v1/unload_lora_adapter: the name, or (older vLLM clients) the int id."""

    lora_name: Optional[str] = None
    lora_int_id: Optional[int] = None


class ServerLoRA:
    """The server's view of the engine's adapters: lookup by name, /v1/models cards, loads and unloads."""

    def __init__(self, state: ServerState):
        self.state = state
        self.runtime_updating = runtime_updating_allowed(state.options.allow_runtime_lora_updating)
        self._last_id = 0  # ids handed out by runtime loads: each above every id in use then
        self._locks: dict[str, asyncio.Lock] = {}  # one load or unload of a name at a time

    # ---- reading the engine's adapters --------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """The engine serves adapters (--enable-lora) and has the adapter API."""
        engine = self.state.engine
        config = getattr(engine, "config", None) if engine is not None else None
        return bool(getattr(config, "enable_lora", False)) and hasattr(engine, "list_loras")

    def adapters(self) -> list[LoRARequest]:
        return list(self.state.engine.list_loras()) if self.enabled else []

    def lookup(self, name: str) -> LoRARequest | None:
        """The loaded adapter a request's `model` names, or None."""
        return next((a for a in self.adapters() if a.lora_name == name), None)

    def parent(self, adapter: LoRARequest) -> str:
        """The served name an adapter's card gives as its parent: its base_model_name when that is one
        of the served names (as vLLM), else the first served name."""
        names = list(self.state.options.served_model_names)
        return adapter.base_model_name if adapter.base_model_name in names else names[0]

    def cards(self) -> list[dict]:
        """One /v1/models card per loaded adapter (vLLM's: id, root = its path, parent = the base)."""
        return [
            {
                "id": a.lora_name,
                "object": "model",
                "created": self.state.created,
                "owned_by": "jaxserve",
                "root": a.lora_path,
                "parent": self.parent(a),
                "max_model_len": self.state.max_model_len,
            }
            for a in self.adapters()
        ]

    def describe(self) -> dict:
        """The LoRA part of /v1/capabilities."""
        config = getattr(self.state.engine, "config", None)
        out: dict[str, Any] = {"enabled": self.enabled, "runtime_updating": self.runtime_updating}
        if self.enabled:
            out.update(
                max_loras=config.max_loras,
                max_lora_rank=config.max_lora_rank,
                max_cpu_loras=config.max_cpu_loras or config.max_loras,
                adapters=[a.lora_name for a in self.adapters()],
            )
        return out

    def next_id(self) -> int:
        """A lora_int_id above every id in use and every id handed out before (taken without an await
        in between, so two concurrent loads never get the same one)."""
        self._last_id = max([self._last_id, *(a.lora_int_id for a in self.adapters())]) + 1
        return self._last_id

    # ---- runtime loads and unloads ------------------------------------------------------------------
    def _check_enabled(self) -> None:
        self.state.check_ready()
        if not self.enabled:
            raise APIError(
                400,
                "LoRA is not enabled on this server: start it with --enable-lora to load adapters",
                code="lora_not_enabled",
            )

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise APIError(
                400,
                "Both 'lora_name' and 'lora_path' must be provided.",
                param="lora_name" if not name else "lora_path",
                code="missing_parameter",
            )
        self._check_enabled()
        if body.is_3d_lora_weight:
            raise APIError(
                400,
                "is_3d_lora_weight (vLLM's 3D MoE adapter weights) is not supported; jaxserve loads PEFT adapters",
                param="is_3d_lora_weight",
                code="unsupported_parameter",
            )
        options = self.state.options
        if name in options.served_model_names or name == options.model_path:
            raise APIError(
                400,
                f"{name!r} is the base model's name: give the adapter another name",
                param="lora_name",
                code="lora_name_taken",
            )
        async with self._lock(name):
            existing = self.lookup(name)
            if existing is not None and not body.load_inplace:
                raise APIError(
                    400,
                    f"The lora adapter '{name}' has already been loaded. If you want to load the "
                    "adapter in place, set 'load_inplace' to True.",
                    param="lora_name",
                    code="lora_adapter_exists",
                )
            request = LoRARequest(name, self.next_id(), path)
            if existing is not None:  # in place: requests running with the old weights finish with them
                await self._remove(name, missing_ok=True)
            try:
                await self.state.engine.add_lora(request)
            except BaseException as err:
                if existing is not None:  # put the old one back: a failed replacement changes nothing
                    await self._restore(existing)
                raise _load_error(err) from None
        logger.info(
            "loaded LoRA adapter %r from %s (lora_int_id %d)%s",
            name,
            path,
            request.lora_int_id,
            " in place" if existing is not None else "",
        )
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        name = body.lora_name
        if not name and body.lora_int_id is None:
            raise APIError(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                param="lora_name",
                code="missing_parameter",
            )
        self._check_enabled()
        if not name:  # older vLLM clients name it by id
            adapter = next((a for a in self.adapters() if a.lora_int_id == body.lora_int_id), None)
            if adapter is None:
                raise self._not_found(f"no LoRA adapter with lora_int_id {body.lora_int_id} is loaded")
            name = adapter.lora_name
        async with self._lock(name):
            await self._remove(name)
        logger.info("unloaded LoRA adapter %r", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def _remove(self, name: str, missing_ok: bool = False) -> None:
        try:
            await self.state.engine.remove_lora(name)
        except LoRANotFoundError:
            if not missing_ok:
                raise self._not_found(f"The lora adapter '{name}' cannot be found.") from None

    async def _restore(self, adapter: LoRARequest) -> None:
        try:
            await self.state.engine.add_lora(adapter)
        except Exception:  # noqa: BLE001 - logged; the client gets the error of its own load
            logger.exception("could not restore LoRA adapter %r after a failed in-place load", adapter.lora_name)

    def _not_found(self, message: str) -> APIError:
        loaded = ", ".join(repr(a.lora_name) for a in self.adapters()) or "none"
        return APIError(
            404,
            f"{message} (loaded: {loaded})",
            type="not_found_error",
            param="lora_name",
            code="lora_adapter_not_found",
        )


def _load_error(err: BaseException) -> BaseException:
    if isinstance(err, LoRAError):  # the engine refused the adapter: a missing file, its rank, a module, ...
        return APIError(400, str(err), param="lora_path", code="invalid_lora_adapter")
    if isinstance(err, Exception):
        return engine_error(err)
    return err  # cancelled: let it through


def add_lora_routes(app: FastAPI, state: ServerState, responses: dict) -> None:
    """vLLM's runtime routes; registered only when runtime updating is allowed (else they are 404s)."""
    logger.warning(
        "runtime LoRA loading and unloading is on (POST %s): any client that can reach /v1 may load "
        "adapters from this host's file system",
        " and ".join(LORA_ROUTES),
    )

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=responses)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return PlainTextResponse(await state.lora.load(body))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=responses)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return PlainTextResponse(await state.lora.unload(body))


__all__ = [
    "LORA_ROUTES",
    "LoadLoRAAdapterRequest",
    "RUNTIME_UPDATING_ENV",
    "ServerLoRA",
    "UnloadLoRAAdapterRequest",
    "add_lora_routes",
    "runtime_updating_allowed",
]
