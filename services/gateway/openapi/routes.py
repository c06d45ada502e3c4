"""What /openapi.json says of each route: its request body, summary and every answer.

TGI's routes answer body rejections in plain text (415, 413, 400, 422 for a wrong shape),
their own errors as TGI's JSON (a 401 too); streaming routes report what fails
after the stream starts inside it. The OpenAI routes answer every error in OpenAI's shape.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel, RootModel

from services.gateway.openai.models import LoadAdapterBody, UnloadAdapterBody
from services.gateway.openai.schemas import ChatBody, CompletionBody
from services.gateway.openapi import models as out
from services.gateway.openapi.document import TEXT, Operation, answer, describe, json_of, sse_of
from services.gateway.tgi.compat import VertexBody
from services.gateway.tgi.schemas import CompatBody, GenerateBody, TokenizeBody


class InvocationsBody(RootModel[CompatBody | ChatBody | CompletionBody]):
    """SageMaker's body: a generate body (`inputs`), a chat (`messages`) or completions
    (`prompt`)."""


TGI_ERROR = json_of(out.ErrorResponse)
OPENAI_ERROR = json_of(out.OpenAIError)
EITHER_ERROR = json_of(out.ErrorResponse, out.OpenAIError)
NO_KEY = answer("Missing or wrong API key (--api-key)", TGI_ERROR)
TOO_LARGE = "The body is larger than --payload-limit"
NOT_JSON_TYPE = "Content-Type is not application/json"
SHAPE_OR_VALUE = "The body has the wrong shape (text), or fails validation (JSON)"


def tgi_json(ok: dict, *, generates: bool = True) -> dict[str, dict]:
    """A TGI route answering JSON: body rejections in text, its errors in TGI's JSON."""
    responses = {
        "200": ok,
        "400": answer("The body is not JSON", TEXT),
        "401": NO_KEY,
        "413": answer(TOO_LARGE, TEXT),
        "415": answer(NOT_JSON_TYPE, TEXT),
        "422": answer(SHAPE_OR_VALUE, TEXT, TGI_ERROR),
    }
    if generates:
        responses |= {
            "424": answer("Generation failed on a worker, or passed its deadline", TGI_ERROR),
            "429": answer("Model is overloaded", TGI_ERROR),
            "500": answer("Incomplete generation", TGI_ERROR),
            "503": answer("Redis or the workers are unreachable", TGI_ERROR),
        }
    return responses


def adapter_responses(success: str) -> dict[str, dict]:
    return {
        "200": answer(success, TEXT),
        "400": answer(
            "Not JSON, the wrong shape, or an adapter that cannot be served", OPENAI_ERROR
        ),
        "401": answer("Missing or wrong API key (--api-key)", OPENAI_ERROR),
        "404": answer("Unload: no adapter of that name", OPENAI_ERROR),
        "413": answer(TOO_LARGE, OPENAI_ERROR),
        "415": answer(NOT_JSON_TYPE, OPENAI_ERROR),
        "503": answer("Redis is unreachable", OPENAI_ERROR),
    }


def tgi_stream(ok: dict) -> dict[str, dict]:
    """/generate_stream: only body rejections are HTTP errors; the rest is in the stream."""
    responses = tgi_json(ok, generates=False)
    responses["422"] = answer("The body has the wrong shape", TEXT)
    return responses


def openai_responses(ok: dict) -> dict[str, dict]:
    return {
        "200": ok,
        "400": answer("Not JSON, wrong shape, or a value the server will not run", OPENAI_ERROR),
        "401": answer("Missing or wrong API key (--api-key)", OPENAI_ERROR),
        "413": answer(TOO_LARGE, OPENAI_ERROR),
        "415": answer(NOT_JSON_TYPE, OPENAI_ERROR),
        "429": answer("Model is overloaded", OPENAI_ERROR),
        "500": answer("Generation failed on a worker", OPENAI_ERROR),
        "503": answer("Redis or the workers are unreachable", OPENAI_ERROR),
    }


def invocations_responses(ok: dict) -> dict[str, dict]:
    """SageMaker's route reads the body (TGI's rejections), then answers as the route the
    body's shape picks: TGI's generate, or OpenAI's chat or completions."""
    return {
        "200": ok,
        "400": answer("Not JSON (text), or refused by the OpenAI route", TEXT, OPENAI_ERROR),
        "401": NO_KEY,
        "413": answer(TOO_LARGE, TEXT),
        "415": answer(NOT_JSON_TYPE, TEXT),
        "422": answer(SHAPE_OR_VALUE, TEXT, TGI_ERROR),
        "424": answer("Generation failed on a worker, or passed its deadline", TGI_ERROR),
        "429": answer("Model is overloaded", EITHER_ERROR),
        "500": answer("Generation failed, or was incomplete", EITHER_ERROR),
        "503": answer("Redis or the workers are unreachable", EITHER_ERROR),
    }


HEALTH = {
    "200": answer("A worker group is ready to generate: no body"),
    "503": answer("Not ready (no worker group, or Redis unreachable)", TGI_ERROR),
}
STREAM = answer(
    "Server-sent events, one `data: {json}` per token; a failure is one error event",
    sse_of(out.StreamResponse, out.ErrorResponse, has_done=False),
)
CHAT = answer(
    "The completion (JSON); with `stream`, its chunks as server-sent events, `data: [DONE]` last",
    json_of(out.ChatCompletion),
    sse_of(out.ChatCompletionChunk, out.OpenAIError),
)
COMPLETIONS = answer(
    "The completions (JSON); with `stream`, chunks as server-sent events, `data: [DONE]` last",
    json_of(out.Completion),
    sse_of(out.Completion, out.OpenAIError),
)

OPERATIONS = {
    ("post", "/generate"): Operation(
        "Generate text (TGI)",
        tgi_json(answer("Generated text", json_of(out.GenerateResponse))),
        GenerateBody,
    ),
    ("post", "/generate_stream"): Operation(
        "Generate text as a stream of server-sent events (TGI)",
        tgi_stream(STREAM),
        GenerateBody,
    ),
    ("post", "/"): Operation(
        "TGI compat route: generate (a one-element array), or stream when `stream` is true",
        tgi_json(
            answer("Generated text, or its stream", json_of(out.CompatResponse), STREAM["content"])
        ),
        CompatBody,
    ),
    ("post", "/tokenize"): Operation(
        "Tokenize `inputs` (ids, texts and byte offsets)",
        tgi_json(answer("The tokens", json_of(out.TokenizeResponse)), generates=False),
        TokenizeBody,
    ),
    ("post", "/chat_tokenize"): Operation(
        "Apply the chat template and tokenize",
        tgi_json(
            answer("The prompt and its tokens", json_of(out.ChatTokenizeResponse)), generates=False
        ),
        ChatBody,
    ),
    ("post", "/vertex"): Operation(
        "Vertex AI: {instances: [...]} -> {predictions: [...]}",
        tgi_json(answer("One generated text per instance", json_of(out.VertexResponse))),
        VertexBody,
    ),
    ("post", "/invocations"): Operation(
        "SageMaker: generate, chat or completions by the body's shape",
        invocations_responses(
            answer(
                "The answer of the route the body's shape picks",
                json_of(out.CompatResponse, out.ChatCompletion, out.Completion),
                sse_of(
                    out.StreamResponse,
                    out.ChatCompletionChunk,
                    out.Completion,
                    out.ErrorResponse,
                    out.OpenAIError,
                ),
            )
        ),
        InvocationsBody,
    ),
    ("post", "/v1/chat/completions"): Operation(
        "OpenAI chat completions (the model's chat template)", openai_responses(CHAT), ChatBody
    ),
    ("post", "/v1/completions"): Operation(
        "OpenAI completions (one prompt or a list)", openai_responses(COMPLETIONS), CompletionBody
    ),
    ("get", "/v1/models"): Operation(
        "OpenAI model list: the served model, then each LoRA adapter",
        {
            "200": answer("The served model and its adapters", json_of(out.ModelList)),
            "503": answer("Redis is unreachable", OPENAI_ERROR),
        },
    ),
    ("post", "/v1/load_lora_adapter"): Operation(
        "Register a LoRA adapter (a PEFT folder) for every gateway and worker group (vLLM's)",
        adapter_responses("Success: LoRA adapter 'NAME' added successfully."),
        LoadAdapterBody,
    ),
    ("post", "/v1/unload_lora_adapter"): Operation(
        "Unregister a LoRA adapter (vLLM's); running requests finish with it",
        adapter_responses("Success: LoRA adapter 'NAME' removed successfully."),
        UnloadAdapterBody,
    ),
    ("get", "/info"): Operation("Model and limits", {"200": answer("Info", json_of(out.Info))}),
    ("get", "/metrics"): Operation(
        "Prometheus metrics (TGI's names)", {"200": answer("The text exposition format", TEXT)}
    ),
    ("get", "/live"): Operation(
        "200 while the process runs", {"200": answer("The gateway runs: no body")}
    ),
    **{
        ("get", path): Operation("200 when a worker group is ready to generate, else 503", HEALTH)
        for path in ("/health", "/", "/ping", "/ready")
    },
}


def describe_routes(app: FastAPI) -> None:
    known = {
        name: model
        for name, model in vars(out).items()
        if isinstance(model, type) and issubclass(model, BaseModel)
    }
    describe(app, OPERATIONS, known)
