"""TGI's remaining routes: POST /chat_tokenize, POST /invocations (SageMaker), POST /vertex
(Vertex AI) and GET /api-doc/openapi.json. Each dispatches to the handlers of the native and
OpenAI routes, so validation, limits and shapes stay the same everywhere."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, RootModel
from pydantic import ValidationError as ShapeError

from services.gateway.openai.routes import answer_chat, chat_completions, completions, render_prompt
from services.gateway.openai.schemas import ChatBody
from services.gateway.openai.tools import plan_tools
from services.gateway.pipeline.body import BodyError, read_json
from services.gateway.pipeline.errors import GatewayError, ValidationError
from services.gateway.pipeline.tokenizer import TokenizerError
from services.gateway.tgi.routes import (
    compat_generate,
    decode,
    gateway,
    handle,
    run_generate,
    unauthorized,
)
from services.gateway.tgi.schemas import GenerateBody

router = APIRouter()


class AnyJson(RootModel[dict[str, Any]]):
    """Any JSON object (routes that sniff their body first)."""


class VertexBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    instances: list[dict[str, Any]]  # each a generate body (`inputs`) or a chat body (`messages`)


async def read_object(request: Request, payload_limit: int) -> dict[str, Any] | Response:
    try:
        return (await read_json(request, AnyJson, payload_limit)).root
    except BodyError as exc:
        return exc.response()


@router.post("/chat_tokenize")
async def chat_tokenize(request: Request) -> Response:
    """The chat template applied to `messages`, and its tokens (behind --api-key: it shows
    the template, and TGI's open route let anyone tokenize without the key)."""
    state = gateway(request)
    body = await decode(state, request, ChatBody)
    if isinstance(body, Response):
        return body
    try:
        prompt = render_prompt(state, body, plan_tools(body))
        spans = state.tokenizer.spans(prompt, add_special_tokens=False)
    except TokenizerError as exc:
        return ValidationError(f"tokenizer error {exc}").response()
    except GatewayError as exc:
        return exc.response()
    return JSONResponse(
        {
            "tokenize_response": [
                {"id": s.id, "text": s.text, "start": s.start, "stop": s.stop} for s in spans
            ],
            "templated_text": prompt,
        }
    )


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    """SageMaker: `messages` -> chat, `prompt` -> completions, else TGI's compat generate."""
    state = gateway(request)
    denied = unauthorized(state, request)  # protected, as in TGI: before the body is read
    if denied is not None:
        return denied
    body = await read_object(request, state.settings.payload_limit)
    if isinstance(body, Response):
        return body
    if "messages" in body:
        return await chat_completions(request)  # the body is cached: it decodes again
    if "prompt" in body:
        return await completions(request)
    return await compat_generate(request)


@router.post("/vertex")
async def vertex(request: Request) -> Response:
    """Vertex AI: {"instances": [...]} -> {"predictions": [generated text, ...]}."""
    return await handle(request, VertexBody, answer_vertex)


async def answer_vertex(state, request: Request, body: VertexBody, arrived_at: float) -> Response:
    if not body.instances:
        return ValidationError("`instances` cannot be empty", param="instances").response()
    try:
        answers = await asyncio.gather(
            *(predict(state, request, instance, arrived_at) for instance in body.instances)
        )
    except GatewayError as exc:
        return exc.response()
    failed = next((a for a in answers if isinstance(a, Response)), None)
    return failed or JSONResponse({"predictions": answers})


async def predict(
    state, request: Request, instance: dict[str, Any], arrived_at: float
) -> str | Response:
    """The generated text of one instance, or the error response that fails the request."""
    try:
        if "messages" in instance:
            chat = ChatBody.model_validate({**instance, "stream": False})
            answer = await answer_chat(state, request, chat, arrived_at)
        else:
            generate = GenerateBody.model_validate(instance)
            answer = await run_generate(state, request, generate, arrived_at, False, as_list=False)
    except ShapeError as exc:
        raise ValidationError(f"invalid instance: {exc.errors()[0]['msg']}") from exc
    if answer.status_code != 200:
        return answer
    payload = json.loads(bytes(answer.body))
    if "choices" in payload:
        return payload["choices"][0]["message"].get("content") or ""
    return payload["generated_text"]


@router.get("/api-doc/openapi.json", include_in_schema=False)
async def openapi_alias(request: Request) -> JSONResponse:
    """TGI's address of the OpenAPI document."""
    return JSONResponse(request.app.openapi())
