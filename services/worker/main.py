"""`textgen worker`: load the model, size the KV cache, serve step plans."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

from services.worker.distributed import (
    PORT_ENV,
    ShardProcesses,
    broadcast_int,
    broadcast_plan,
    follow,
    join_group,
    shard_rank,
)
from services.worker.fake import fake_model
from services.worker.loader import LoadedModel, UnsupportedModel, load_model, pick_device
from services.worker.quantization import QuantizationError
from services.worker.runtime import build_runner
from services.worker.service import WorkerService
from shared import aio
from shared.adapters import AdapterError
from shared.bus import wait_for_redis
from shared.openmp import cpu_list, move_to_io_cpus
from shared.ops_server import OpsServer
from shared.redis_connect import client_for
from shared.settings import Settings
from shared.telemetry import new_registry, setup_tracing

log = logging.getLogger(__name__)


async def serve(settings: Settings) -> None:
    if not settings.has_redis:
        raise SystemExit("textgen worker needs --redis-url or --redis-sentinels")
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
    redis = client_for(settings)
    await wait_for_redis(redis)
    # Every torch call of this process runs on this one thread: loading, the KV cache, the
    # collectives and every forward. libgomp gives each thread that enters a parallel region a
    # team of its own, and with more team threads than cores it spins only briefly at barriers
    # before sleeping; a second team (the model loaded on another thread) cut throughput by a
    # fifth and left a core a third idle.
    torch_thread = ThreadPoolExecutor(1, thread_name_prefix="torch")
    loop = asyncio.get_running_loop()

    def on_torch_thread(function, *args, **kwargs):
        return loop.run_in_executor(torch_thread, functools.partial(function, *args, **kwargs))

    shards: ShardProcesses | None = None
    device = settings.device
    if settings.num_shard > 1:  # rank 0 of a tensor-parallel group
        shards = ShardProcesses(settings.num_shard)
        shard = await on_torch_thread(
            join_group, 0, settings.num_shard, shards.port, pick_device(device)
        )
        device = str(shard.device)
    if settings.fake_step_ms is not None:  # simulated worker: no weights
        loaded = await on_torch_thread(fake_model, settings.model_id, settings.revision)
    else:
        loaded = await on_torch_thread(_load, settings, device)
    service = await on_torch_thread(
        WorkerService,
        settings,
        loaded,
        redis,
        on_plan=broadcast_plan if shards is not None else None,
        torch_thread=torch_thread,
    )
    if shards is not None:
        await on_torch_thread(broadcast_int, service.runner.kv_cache.num_blocks)
        shards.watch()
    io_cpus = move_to_io_cpus()  # the torch thread exists: it stays on the workers' CPUs
    if io_cpus is not None:
        log.info("event loop on CPUs %s; forward passes on the workers'", cpu_list(io_cpus))
    holder.append(service)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, service.request_stop)
    if ops is not None:
        ops.registry = service.metrics.registry
    try:
        await service.run()
    finally:
        if shards is not None:
            await asyncio.to_thread(shards.stop)


def _load(settings: Settings, device: str | None) -> LoadedModel:
    return load_model(
        settings.model_id,
        settings.revision,
        settings.dtype,
        device,
        settings.trust_remote_code,
        settings.quantize,
        settings.num_shard,
        cpu_kernels=not settings.disable_cpu_kernels,
    )


def follow_rank_0(settings: Settings, rank: int) -> None:
    """Ranks 1..N-1 of a tensor-parallel group: join, load this rank's shard, size the cache
    as rank 0 did, then run the plans rank 0 broadcasts."""
    port = int(os.environ[PORT_ENV])
    shard = join_group(rank, settings.num_shard, port, pick_device(settings.device))
    loaded = _load(settings, str(shard.device))
    num_blocks = broadcast_int(0)  # as rank 0 sized its cache; the block size is the same rule
    follow(
        build_runner(
            loaded,
            block_size=settings.block_size,
            num_blocks=num_blocks,
            speculate=settings.speculate,
            grammar_compile_timeout=None,  # as rank 0: no grammars in a tensor-parallel group
            max_loras=settings.max_loras,
        )
    )


def run(settings: Settings) -> None:
    setup_tracing("worker", settings.otlp_endpoint)
    if settings.num_shard > 1 and settings.fake_step_ms is not None:
        raise SystemExit("--fake-step-ms simulates one rank: drop --num-shard")
    try:
        rank = shard_rank()
        if rank:
            follow_rank_0(settings, rank)
            return
        aio.run(serve(settings))
    except (UnsupportedModel, QuantizationError, AdapterError) as exc:
        raise SystemExit(f"textgen worker: {exc}") from exc
