"""Logging, tracing and metrics set-up shared by every service.

- Logging: one format, level from settings; JSON lines when asked.
- Tracing: OpenTelemetry API. The gateway's span context travels in messages as a W3C
  `traceparent` string (`inject_traceparent` / `extract_context`), so one trace spans
  gateway -> scheduler -> worker. With no SDK configured every span is a no-op.
- Metrics: prometheus_client objects live in each service's own `metrics.py` on a registry
  made here; scheduler and worker expose them on `--metrics-port` (shared/ops_server.py).
"""

from __future__ import annotations

import json
import logging
import sys
import time

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry

_propagator = TraceContextTextMapPropagator()


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload)


def setup_logging(service: str, level: str = "INFO", json_output: bool = False) -> None:
    """Configure the root logger once per process."""
    handler = logging.StreamHandler(sys.stderr)
    if json_output:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def setup_tracing(service: str, otlp_endpoint: str | None) -> None:
    """Install an SDK tracer provider exporting to OTLP when an endpoint is configured."""
    if not otlp_endpoint:
        return
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logging.getLogger(__name__).warning(
            "otlp_endpoint set but opentelemetry-exporter-otlp is not installed; tracing off"
        )
        return
    provider = TracerProvider(resource=Resource.create({"service.name": f"textgen-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    trace.set_tracer_provider(provider)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_traceparent() -> str:
    """The current span's context as a `traceparent` string ("" when no span is recording)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent", "")


def extract_context(traceparent: str) -> otel_context.Context | None:
    """A context to parent spans on, from a `traceparent` string."""
    if not traceparent:
        return None
    return _propagator.extract({"traceparent": traceparent})


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def now() -> float:
    """Wall-clock unix seconds (the one clock that crosses processes)."""
    return time.time()
