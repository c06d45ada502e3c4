"""Which request model and summary each route has in the OpenAPI document."""

from __future__ import annotations

from fastapi import FastAPI

from services.gateway.compat_routes import VertexBody
from services.gateway.openai_schemas import ChatBody, CompletionBody
from services.gateway.openapi import describe
from services.gateway.schemas import CompatBody, GenerateBody, TokenizeBody

BODIES = {
    ("post", "/generate"): GenerateBody,
    ("post", "/generate_stream"): GenerateBody,
    ("post", "/"): CompatBody,
    ("post", "/tokenize"): TokenizeBody,
    ("post", "/v1/chat/completions"): ChatBody,
    ("post", "/v1/completions"): CompletionBody,
    ("post", "/chat_tokenize"): ChatBody,
    ("post", "/vertex"): VertexBody,
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
    ("post", "/v1/chat/completions"): "OpenAI chat completions (the model's chat template)",
    ("post", "/v1/completions"): "OpenAI completions (one prompt or a list)",
    ("get", "/v1/models"): "OpenAI model list (the served model)",
    ("post", "/chat_tokenize"): "Apply the chat template and tokenize",
    ("post", "/invocations"): "SageMaker: generate, chat or completions by the body's shape",
    ("post", "/vertex"): "Vertex AI: {instances: [...]} -> {predictions: [...]}",
}
STREAMS = {("post", "/generate_stream")}


def describe_routes(app: FastAPI) -> None:
    describe(app, BODIES, SUMMARIES, STREAMS)
