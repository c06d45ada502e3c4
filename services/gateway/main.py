"""`textgen gateway`: serve the gateway app with uvicorn."""

from __future__ import annotations

import math
import sys

import uvicorn

from services.gateway.app import create_app
from shared import aio
from shared.settings import Settings
from shared.telemetry import setup_logging, setup_tracing

STARTUP_FAILURE = 3  # uvicorn.run's exit status when the server never started


def run(settings: Settings) -> None:
    """Start the gateway on settings.hostname:settings.port (blocks until stopped). As the
    other services, on shared.aio's loop: SIGUSR1 dumps its threads' and tasks' stacks (under
    uvicorn.run the signal killed it)."""
    setup_logging("gateway", settings.log_level, settings.json_output)
    setup_tracing("gateway", settings.otlp_endpoint)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.hostname,
        port=settings.port,
        log_level=settings.log_level.lower(),
        # SIGTERM: stop accepting, let open streams finish for up to the grace period
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace),
        log_config=None,
    )
    server = uvicorn.Server(config)
    aio.run(server.serve())
    if not server.started:  # the port was taken, say: uvicorn logged why
        sys.exit(STARTUP_FAILURE)
