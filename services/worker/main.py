"""`textgen worker`: load the model, size the KV cache, serve step plans."""

from __future__ import annotations

import asyncio
import logging

from services.worker.loader import load_model
from services.worker.service import WorkerService
from shared.bus import connect, wait_for_redis
from shared.settings import Settings
from shared.telemetry import serve_metrics, setup_tracing

log = logging.getLogger(__name__)


async def serve(settings: Settings) -> None:
    if not settings.redis_url:
        raise SystemExit("textgen worker needs --redis-url")
    redis = connect(settings.redis_url)
    await wait_for_redis(redis)
    loaded = await asyncio.to_thread(
        load_model,
        settings.model_id,
        settings.revision,
        settings.dtype,
        settings.device,
        settings.trust_remote_code,
    )
    service = WorkerService(settings, loaded, redis)
    serve_metrics(service.metrics.registry, settings.metrics_port)
    await service.run()


def run(settings: Settings) -> None:
    setup_tracing("worker", settings.otlp_endpoint)
    if settings.num_shard != 1:
        raise SystemExit("--num-shard > 1 is not supported yet")
    if settings.quantize:
        raise SystemExit(f"--quantize {settings.quantize} is not supported yet")
    asyncio.run(serve(settings))
