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
import os
import sys
import time
from typing import NoReturn

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


EXPORT_DELAY_MS = 500  # spans leave the process in batches at most this late
_tracing = {"enabled": False}  # set once at start-up by setup_tracing


def setup_tracing(service: str, otlp_endpoint: str | None) -> None:
    """Export spans with OTLP over HTTP to `otlp_endpoint` (http://host:4318 or a full
    .../v1/traces URL). Without an endpoint nothing is installed and spans cost nothing."""
    if not otlp_endpoint:
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    endpoint = otlp_endpoint.rstrip("/")
    if not endpoint.endswith("/v1/traces"):
        endpoint += "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": f"textgen-{service}"}))
    provider.add_span_processor(
        BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=EXPORT_DELAY_MS
        )
    )
    trace.set_tracer_provider(provider)
    _tracing["enabled"] = True
    logging.getLogger(__name__).info("tracing: OTLP/HTTP to %s", endpoint)


def exit_flushed(code: int) -> NoReturn:
    """End a service that has stopped: its spans exported and its logs written, then out at
    once, without the interpreter's teardown (a worker spent 2-3 s of every stop there:
    collecting torch's, transformers' and the model's objects, torch.library's finalizers)."""
    if _tracing["enabled"]:
        provider = trace.get_tracer_provider()
        shutdown = getattr(provider, "shutdown", None)  # the SDK's provider: flushes spans
        if shutdown is not None:
            shutdown()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def is_tracing() -> bool:
    """True when spans are exported (build optional spans only then)."""
    return _tracing["enabled"]


def record_span(
    name: str,
    traceparent: str,
    start_s: float,
    end_s: float,
    attributes: dict[str, str | int | float | bool] | None = None,
) -> None:
    """A finished span, after the fact, parented on a message's trace context (no-op when
    tracing is off). Times are unix seconds."""
    if not _tracing["enabled"] or not traceparent:
        return
    span = trace.get_tracer("textgen").start_span(
        name,
        context=extract_context(traceparent),
        start_time=int(start_s * 1e9),
        attributes=attributes or {},
    )
    span.end(end_time=int(max(end_s, start_s) * 1e9))


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
