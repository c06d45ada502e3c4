"""`textgen scheduler`: drive one worker group."""

from __future__ import annotations

import asyncio
import signal

from services.scheduler.service import SchedulerService
from shared import aio
from shared.bus import wait_for_redis
from shared.ops_server import OpsServer
from shared.redis_connect import client_for
from shared.settings import Settings
from shared.telemetry import setup_tracing


async def serve(settings: Settings) -> None:
    if not settings.has_redis:
        raise SystemExit("textgen scheduler needs --redis-url or --redis-sentinels")
    redis = client_for(settings)
    await wait_for_redis(redis)
    service = SchedulerService(settings, redis)
    if settings.metrics_port:
        ready = lambda: service.scheduler is not None  # noqa: E731 (its worker group announced)
        await OpsServer(service.metrics.registry, ready, "0.0.0.0", settings.metrics_port).start()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, service.request_stop)
    await service.run()


def run(settings: Settings) -> None:
    setup_tracing("scheduler", settings.otlp_endpoint)
    aio.run(serve(settings))
