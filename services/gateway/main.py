"""`textgen gateway`: serve the gateway app with uvicorn."""

from __future__ import annotations

import math

import uvicorn

from services.gateway.app import create_app
from shared.settings import Settings
from shared.telemetry import setup_logging, setup_tracing


def run(settings: Settings) -> None:
    """Start the gateway on settings.hostname:settings.port (blocks until stopped)."""
    setup_logging("gateway", settings.log_level, settings.json_output)
    setup_tracing("gateway", settings.otlp_endpoint)
    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.hostname,
        port=settings.port,
        log_level=settings.log_level.lower(),
        # SIGTERM: stop accepting, let open streams finish for up to the grace period
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace),
        log_config=None,
    )
