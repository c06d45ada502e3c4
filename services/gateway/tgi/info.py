"""Info and operations routes: /info, /health (+ GET /, /ping, /ready), /live, /metrics and
POST /tokenize. Only /tokenize is protected by --api-key, as in TGI."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.metrics import CONTENT_TYPE
from services.gateway.pipeline.errors import ValidationError, unhealthy
from services.gateway.pipeline.tokenizer import TokenizerError
from services.gateway.state import GatewayState
from services.gateway.tgi.routes import decode, gateway
from services.gateway.tgi.schemas import TokenizeBody
from shared.bus import REDIS_FAILURES, as_bytes
from shared.codec import decode as decode_message
from shared.messages import Heartbeat, WorkerReady
from shared.settings import step_tokens

log = logging.getLogger(__name__)
router = APIRouter()
HEALTH_TIMEOUT_S = 2.0


async def has_ready_group(state: GatewayState) -> bool:
    """Redis answers and some worker group has its WorkerReady key and a live heartbeat whose
    last step succeeded (busy is not unhealthy: a full queue does not matter here)."""
    client, channels = state.redis(), state.channels
    if state.router is None or not state.router.is_subscribed:
        return False  # Redis is down (the reply subscription is retrying): answer at once
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            groups = await client.smembers(channels.groups)
            if not groups:
                return False
            async with client.pipeline(transaction=False) as pipe:
                for raw in groups:
                    group = raw.decode() if isinstance(raw, bytes) else str(raw)
                    pipe.exists(channels.worker(group))
                    pipe.get(channels.heartbeat(group))
                replies = await pipe.execute()
    except REDIS_FAILURES as exc:
        log.debug("health check: Redis unreachable: %s", exc)
        return False
    for has_worker, beat in zip(replies[::2], replies[1::2], strict=True):
        if has_worker and beat is not None and decode_message(beat, Heartbeat).is_last_step_ok:
            return True
    return False


async def any_worker(state: GatewayState) -> WorkerReady | None:
    """The WorkerReady of some registered group (they all serve the one model), or None."""
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            for raw in sorted(await state.redis().smembers(state.channels.groups)):
                group = raw.decode() if isinstance(raw, bytes) else str(raw)
                ready = await state.redis().get(state.channels.worker(group))
                if ready is not None:
                    return decode_message(as_bytes(ready), WorkerReady)
    except REDIS_FAILURES as exc:
        log.debug("/info: Redis unreachable: %s", exc)
    return None


async def health(request: Request) -> Response:
    if await has_ready_group(gateway(request)):
        return Response(status_code=200)
    return unhealthy().response()


for path in ("/health", "/", "/ping", "/ready"):
    router.add_api_route(path, health, methods=["GET"])


@router.get("/live")
async def live() -> Response:
    return Response(status_code=200)


@router.get("/info")
async def info(request: Request) -> JSONResponse:
    state = gateway(request)
    settings, limits = state.settings, state.limits
    worker = await any_worker(state)
    try:
        adapters = [ref.name for ref in await state.adapters().all()]
    except REDIS_FAILURES as exc:
        log.debug("/info: Redis unreachable: %s", exc)
        adapters = None
    return JSONResponse(
        {
            "model_id": settings.model_id,
            "model_sha": None,
            "model_pipeline_tag": None,
            "max_concurrent_requests": settings.max_concurrent_requests,
            "max_best_of": limits.max_best_of,
            "max_stop_sequences": limits.max_stop_sequences,
            "max_input_tokens": limits.max_input_tokens,
            "max_total_tokens": limits.max_total_tokens,
            "validation_workers": 2,
            "max_client_batch_size": settings.max_client_batch_size,
            "router": "textgen",
            "version": state.version,
            "sha": None,
            "docker_label": None,
            # 2.x fields, still read by some dashboards
            "max_input_length": limits.max_input_tokens,
            "max_batch_total_tokens": settings.max_batch_total_tokens,
            "max_batch_prefill_tokens": step_tokens(
                settings.max_batch_prefill_tokens,
                worker.device if worker else "cpu",
                worker.step_tokens if worker else 0,
            )
            if worker or settings.max_batch_prefill_tokens
            else None,
            "max_waiting_tokens": settings.max_waiting_tokens,
            "max_batch_size": settings.max_batch_size,
            "waiting_served_ratio": settings.waiting_served_ratio,
            "max_top_n_tokens": limits.max_top_n_tokens,
            # from a worker group; null until one has loaded the model
            "model_dtype": worker.dtype if worker else None,
            "model_device_type": worker.device.split(":")[0] if worker else None,
            # "paged": attention reads the paged KV cache; "fallback": each request runs on
            # the model's own cache (causal LMs outside transformers' attention interface);
            # "seq2seq": encoder-decoders, the same way
            "model_runner": worker.runner if worker else None,
            # "flash-attn": the paged runner attends with flash-attn (CUDA, installed); "sdpa":
            # with torch's scaled_dot_product_attention (and matmuls on CPU)
            "model_attention": worker.attention if worker else None,
            # structured output: the grammar engine, or null with --disable-grammar-support;
            # n-gram speculation (--speculate) proposes no tokens for constrained requests
            "grammar_backend": None if settings.disable_grammar_support else "llguidance",
            "speculate": worker.num_speculative_tokens if worker else None,
            "speculate_constrained": False,
            "tool_call_parser": settings.tool_call_parser,
            # LoRA adapters registered (select with `model` or `adapter_id`), null while Redis
            # is unreachable; each worker group holds up to max_loras of them at once
            "lora_adapters": adapters,
            "max_loras": worker.max_loras if worker else None,
        }
    )


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(gateway(request).metrics.render(), media_type=CONTENT_TYPE)


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    state = gateway(request)
    body = await decode(state, request, TokenizeBody)
    if isinstance(body, Response):
        return body
    try:
        spans = state.tokenizer.spans(body.inputs, body.parameters.truncate)
    except TokenizerError as exc:
        return ValidationError(f"tokenizer error {exc}").response()
    return JSONResponse(
        [{"id": s.id, "text": s.text, "start": s.start, "stop": s.stop} for s in spans]
    )
