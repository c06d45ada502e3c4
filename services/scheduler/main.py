"""`textgen scheduler`: drive one worker group."""

from __future__ import annotations

import asyncio

from services.scheduler.service import SchedulerService
from shared.bus import connect, wait_for_redis
from shared.settings import Settings
from shared.telemetry import serve_metrics, setup_tracing


async def serve(settings: Settings) -> None:
    if not settings.redis_url:
        raise SystemExit("textgen scheduler needs --redis-url")
    redis = connect(settings.redis_url)
    await wait_for_redis(redis)
    service = SchedulerService(settings, redis)
    serve_metrics(service.metrics.registry, settings.metrics_port)
    await service.run()


def run(settings: Settings) -> None:
    setup_tracing("scheduler", settings.otlp_endpoint)
    asyncio.run(serve(settings))
