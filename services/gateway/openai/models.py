"""GET /v1/models (the base model and every LoRA adapter, as vLLM lists them) and vLLM's run-time
adapter routes, POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter.

Loading registers the adapter in Redis (shared/adapters.py): every gateway accepts its name at
once and a worker group reads its folder when a request first uses it, so the folder must be
readable where the gateway runs (its config is checked here) and where the workers run. Both
adapter routes are behind --api-key; /v1/models is not (as in TGI).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from services.gateway.openai.errors import error_object
from services.gateway.openai.routes import decode_openai
from services.gateway.pipeline.adapters import base_names
from services.gateway.state import GatewayState
from services.gateway.tgi.routes import gateway
from shared.adapters import AdapterError, make_ref
from shared.bus import REDIS_ERRORS

log = logging.getLogger(__name__)
router = APIRouter()


class LoadAdapterBody(BaseModel):
    """vLLM's body of /v1/load_lora_adapter."""

    model_config = ConfigDict(strict=True, extra="ignore")

    lora_name: str  # the name clients select it by (OpenAI `model`, TGI `adapter_id`)
    lora_path: str  # a PEFT folder: adapter_config.json + adapter_model.safetensors


class UnloadAdapterBody(BaseModel):
    """vLLM's body of /v1/unload_lora_adapter."""

    model_config = ConfigDict(strict=True, extra="ignore")

    lora_name: str


def error(message: str, status: int, code: str) -> JSONResponse:
    return JSONResponse(error_object(message, status, code, None), status_code=status)


def unreachable(exc: Exception) -> JSONResponse:
    return error(f"the LoRA adapter registry is unreachable: {exc}", 503, "unavailable")


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The base model, then each registered adapter (`parent`: the base, `root`: its folder)."""
    state = gateway(request)
    model_id = state.settings.model_id
    data = [{"id": model_id, "object": "model", "created": 0, "owned_by": model_id}]
    try:
        adapters = await state.adapters().all()
    except REDIS_ERRORS as exc:
        return unreachable(exc)
    data += [
        {
            "id": ref.name,
            "object": "model",
            "created": ref.created,
            "owned_by": model_id,
            "root": ref.path,
            "parent": model_id,
        }
        for ref in adapters
    ]
    return JSONResponse({"object": "list", "data": data})


class AdapterNotFound(AdapterError):
    """No adapter of that name is registered (404)."""

    code = "adapter_not_found"


async def change_registry(
    request: Request, model: type[BaseModel], change: Callable[[GatewayState, Any], Awaitable[str]]
) -> Response:
    """Decode the body, then `change` the registry: its success text, or the error (400 for
    an adapter that cannot be served, 503 while Redis is unreachable)."""
    state = gateway(request)
    body = await decode_openai(state, request, model)
    if isinstance(body, Response):
        return body
    try:
        return PlainTextResponse(await change(state, body))
    except AdapterError as exc:
        return error(str(exc), 404 if isinstance(exc, AdapterNotFound) else 400, exc.code)
    except REDIS_ERRORS as exc:
        return unreachable(exc)


async def load(state: GatewayState, body: LoadAdapterBody) -> str:
    name = body.lora_name
    ref = make_ref(name, body.lora_path, state.settings.max_lora_rank, base_names(state))
    if not await state.adapters().add(ref):
        raise AdapterError(f"The lora adapter '{name}' has already been loaded.", "adapter_exists")
    log.info("LoRA adapter %s registered from %s", name, ref.path)
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload(state: GatewayState, body: UnloadAdapterBody) -> str:
    name = body.lora_name
    if not await state.adapters().remove(name):
        raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
    log.info("LoRA adapter %s unregistered", name)
    return f"Success: LoRA adapter '{name}' removed successfully."


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    return await change_registry(request, LoadAdapterBody, load)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    return await change_registry(request, UnloadAdapterBody, unload)
