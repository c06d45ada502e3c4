"""Which request model and summary each route has in the OpenAPI document."""

from __future__ import annotations

from fastapi import FastAPI

from services.gateway.openapi import describe
from services.gateway.schemas import CompatBody, GenerateBody, TokenizeBody

BODIES = {
    ("post", "/generate"): GenerateBody,
    ("post", "/generate_stream"): GenerateBody,
    ("post", "/"): CompatBody,
    ("post", "/tokenize"): TokenizeBody,
}
SUMMARIES = {
    ("post", "/generate"): "Generate text (TGI)",
    ("post", "/generate_stream"): "Generate text as a stream of server-sent events (TGI)",
    ("post", "/"): "TGI compat route: generate, or stream when `stream` is true",
    ("post", "/tokenize"): "Tokenize `inputs` (ids, texts and byte offsets)",
    ("get", "/info"): "Model and limits",
    ("get", "/health"): "200 when a worker group is ready to generate, else 503",
    ("get", "/live"): "200 while the process runs",
    ("get", "/metrics"): "Prometheus metrics (TGI's names)",
}
STREAMS = {("post", "/generate_stream")}


def describe_routes(app: FastAPI) -> None:
    describe(app, BODIES, SUMMARIES, STREAMS)
