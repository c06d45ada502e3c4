"""`textgen worker`: load the model, size the KV cache, serve step plans."""

from __future__ import annotations

import asyncio
import logging
import signal

from services.worker.fake import fake_model
from services.worker.loader import UnsupportedModel, load_model
from services.worker.quantization import QuantizationError
from services.worker.service import WorkerService
from shared.bus import connect, wait_for_redis
from shared.model_files import ModelNotFound
from shared.ops_server import OpsServer
from shared.settings import Settings
from shared.telemetry import new_registry, setup_tracing

log = logging.getLogger(__name__)


async def serve(settings: Settings) -> None:
    if not settings.redis_url:
        raise SystemExit("textgen worker needs --redis-url")
    holder: list[WorkerService] = []  # the service, once the model is loaded
    ops = None
    if settings.metrics_port:
        ops = OpsServer(
            new_registry(),
            lambda: bool(holder) and holder[0].is_last_step_ok,
            "0.0.0.0",
            settings.metrics_port,
        )
        await ops.start()  # /live answers during a long model download
    redis = connect(settings.redis_url)
    await wait_for_redis(redis)
    if settings.fake_step_ms is not None:  # simulated worker: no weights
        loaded = await asyncio.to_thread(fake_model, settings.model_id, settings.revision)
    else:
        loaded = await asyncio.to_thread(
            load_model,
            settings.model_id,
            settings.revision,
            settings.dtype,
            settings.device,
            settings.trust_remote_code,
            settings.quantize,
        )
    service = WorkerService(settings, loaded, redis)
    holder.append(service)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, service.request_stop)
    if ops is not None:
        ops.registry = service.metrics.registry
    await service.run()


def run(settings: Settings) -> None:
    setup_tracing("worker", settings.otlp_endpoint)
    if settings.num_shard != 1:
        raise SystemExit("--num-shard > 1 is not supported yet")
    try:
        asyncio.run(serve(settings))
    except (UnsupportedModel, ModelNotFound, QuantizationError) as exc:
        raise SystemExit(f"textgen worker: {exc}") from exc
