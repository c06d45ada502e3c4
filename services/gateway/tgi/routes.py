"""TGI's generation routes: POST /generate, POST /generate_stream and the compat POST /.

Order of checks per request (TGI §4): body decoding (plain-text 4xx), the pre-gate checks,
the concurrency gate, parameter validation, tokenization and length rules, then generation.
On streaming routes everything after body decoding is reported in-stream with HTTP 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from services.gateway.pipeline.adapters import resolve as resolve_adapter
from services.gateway.pipeline.admission import admit
from services.gateway.pipeline.auth import is_authorized
from services.gateway.pipeline.body import read_json
from services.gateway.pipeline.errors import BodyError, GatewayError
from services.gateway.pipeline.fanout import collect, gather_or_fail
from services.gateway.pipeline.results import Finished, KeepAlive, Prepared, Token
from services.gateway.state import GatewayState
from services.gateway.tgi.formatting import (
    KEEPALIVE,
    mean_logprob,
    sequence_details,
    sse,
    stream_details,
    stream_event,
    stream_headers,
    timing_headers,
)
from services.gateway.tgi.schemas import CompatBody, GenerateBody
from services.gateway.tgi.validation import (
    ValidatedParameters,
    check_gates,
)

T = TypeVar("T")
Body = TypeVar("Body", bound=BaseModel)  # a request body model
KEEPALIVE_S = 15.0
router = APIRouter()


def gateway(request: Request) -> GatewayState:
    return request.app.state.gateway


def unauthorized(state: GatewayState, request: Request) -> Response | None:
    """401 when --api-key is set and the request does not carry it. TGI's body is empty,
    which the text-generation client fails to parse (a JSONDecodeError): this one is TGI's
    error JSON, which every TGI client reads."""
    if is_authorized(state.settings.api_key, request.headers.get("authorization")):
        return None
    state.metrics.request_unauthorized()
    return GatewayError(401, "Unauthorized: missing or wrong API key", "unauthorized").response(
        headers={"WWW-Authenticate": "Bearer"}
    )


def shows_full_text(params: ValidatedParameters, route_default: bool) -> bool:
    """return_full_text as asked, else the route's default."""
    return route_default if params.return_full_text is None else params.return_full_text


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work` unless the client disconnects first (then cancel it and return None)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return await task
    return None


async def run_generate(
    state: GatewayState,
    request: Request,
    body: GenerateBody,
    arrived_at: float,
    default_full_text: bool,
    as_list: bool,
) -> Response:
    """Non-streaming generation, best_of included (its runs differ by their random seeds)."""
    state.metrics.request_started()
    params = body.parameters
    try:
        best_of = check_gates(params, state.limits, is_stream=False)
        adapter = await resolve_adapter(state, params.adapter_id, strict=False)
        admitted = await admit(
            state, [body.inputs], [params] * best_of, arrived_at, adapter=adapter
        )
        try:
            runs = [collect(state.generations().stream(p)) for p in admitted.generations]
            results = await until_disconnect(request, gather_or_fail(runs))
        finally:
            admitted.held.release()
    except GatewayError as exc:
        state.metrics.request_failed(exc.metric_label)
        return exc.response()
    if results is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    validated = admitted.generations[0].params
    full_text = shows_full_text(validated, default_full_text)
    answer, finished = generate_answer(results, body.inputs, validated, full_text)
    headers = timing_headers(finished, state.compute_type, len(body.inputs))
    return JSONResponse([answer] if as_list else answer, headers=headers)


def generate_answer(
    results: list[tuple[list[Token], Finished]],
    inputs: str,
    params: ValidatedParameters,
    full_text: bool,
) -> tuple[dict[str, Any], Finished]:
    """The /generate JSON: winner = highest mean logprob, the others in best_of_sequences."""
    ranked = sorted(results, key=lambda result: mean_logprob(result[0]), reverse=True)
    prefix = inputs if full_text else ""
    tokens, finished = ranked[0] if len(results) > 1 else results[0]
    answer: dict[str, Any] = {"generated_text": prefix + finished.generated_text}
    if params.has_details:
        details = sequence_details(tokens, finished, params.top_n_tokens)
        if len(results) > 1:
            details["best_of_sequences"] = [
                {
                    "generated_text": prefix + other.generated_text,
                    **sequence_details(other_tokens, other, params.top_n_tokens),
                }
                for other_tokens, other in ranked[1:]
            ]
        answer["details"] = details
    return answer, finished


async def sse_events(
    state: GatewayState, body: GenerateBody, arrived_at: float, default_full_text: bool
) -> AsyncIterator[str]:
    """The SSE body of a streaming generation; every failure, admission's included, becomes
    one error event (TGI answers 200 once a stream is asked for)."""
    state.metrics.request_started()
    params = body.parameters
    try:
        check_gates(params, state.limits, is_stream=True)
        adapter = await resolve_adapter(state, params.adapter_id, strict=False)
        admitted = await admit(state, [body.inputs], [params], arrived_at, adapter=adapter)
        try:
            (prepared,) = admitted.generations
            full_text = shows_full_text(prepared.params, default_full_text)
            async for chunk in token_events(state, prepared, full_text):
                yield chunk
        finally:
            admitted.held.release()
    except GatewayError as exc:
        state.metrics.request_failed(exc.metric_label)
        yield sse(exc.body())


async def token_events(state: GatewayState, prepared: Prepared, full_text: bool):
    """One event per token; the last one also has the text and the details."""
    params = prepared.params
    prefix = prepared.inputs if full_text else ""
    last: Token | None = None
    async for item in state.generations().stream(prepared, keepalive_s=KEEPALIVE_S):
        if isinstance(item, KeepAlive):
            yield KEEPALIVE
        elif isinstance(item, Token):
            last = item
            yield sse(stream_event(item, params.top_n_tokens, None, None))
        else:  # the end; one without a token repeats the last token's event
            final = item.last_token or last
            if final is not None:
                details = stream_details(item) if params.has_details else None
                text = prefix + item.generated_text
                yield sse(stream_event(final, params.top_n_tokens, text, details))
            return


def stream_response(
    state: GatewayState, body: GenerateBody, arrived_at: float, default_full_text: bool
) -> StreamingResponse:
    return StreamingResponse(
        sse_events(state, body, arrived_at, default_full_text),
        media_type="text/event-stream",
        headers=stream_headers(state.compute_type, len(body.inputs)),
    )


async def decode(state: GatewayState, request: Request, model: type[Body]) -> Body | Response:
    denied = unauthorized(state, request)
    if denied is not None:
        return denied
    try:
        return await read_json(request, model, state.settings.payload_limit)
    except BodyError as exc:
        return exc.response()


Answer = Callable[[GatewayState, Request, Any, float], Awaitable[Response]]


async def handle(request: Request, model: type[BaseModel], answer: Answer) -> Response:
    """A TGI route: its arrival time, the key and the body (TGI's rejections), then `answer`
    (state, request, body, arrived_at)."""
    arrived_at, state = time.time(), gateway(request)
    body = await decode(state, request, model)
    if isinstance(body, Response):
        return body
    return await answer(state, request, body, arrived_at)


async def answer_generate(state, request, body: GenerateBody, arrived_at: float) -> Response:
    return await run_generate(state, request, body, arrived_at, False, as_list=False)


async def answer_stream(state, request, body: GenerateBody, arrived_at: float) -> Response:
    return stream_response(state, body, arrived_at, default_full_text=False)


async def answer_compat(state, request, body: CompatBody, arrived_at: float) -> Response:
    """`stream` picks SSE; non-stream answers a one-element array. return_full_text defaults
    to true here (local models have no pipeline tag: quirk)."""
    if body.stream:
        return stream_response(state, body, arrived_at, default_full_text=True)
    return await run_generate(state, request, body, arrived_at, True, as_list=True)


@router.post("/generate")
async def generate(request: Request) -> Response:
    return await handle(request, GenerateBody, answer_generate)


@router.post("/generate_stream")
async def generate_stream(request: Request) -> Response:
    return await handle(request, GenerateBody, answer_stream)


@router.post("/")
async def compat_generate(request: Request) -> Response:
    """TGI's compat route (what the text-generation client and huggingface_hub post to)."""
    return await handle(request, CompatBody, answer_compat)
