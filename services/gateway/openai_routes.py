"""The OpenAI-compatible routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

Each prompt is one TGI generation (`generation()` below): the same checks in the same order as
/generate (gates, concurrency gate, validation, tokenization and length rules), then
`Generator.stream`. Chat prompts come from the model's chat template and are tokenized without
special tokens (the template has them); completion prompts get BOS like /generate. Template and
tool errors are real 422s even when streaming; anything later in a stream is an in-stream
`{"error": {...}}` event, and every stream ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.gateway.chat_template import no_template
from services.gateway.errors import GatewayError, ValidationError, incomplete_generation, overloaded
from services.gateway.formatting import sse, timing_headers
from services.gateway.generation import Finished, KeepAlive, Prepared, Token
from services.gateway.openai_format import (
    DONE,
    Envelope,
    chat_chunk,
    chat_completion,
    chat_usage_chunk,
    completion,
    completion_chunk,
    stream_error,
    summed_headers,
    visible_text,
)
from services.gateway.openai_params import (
    chat_parameters,
    check_chat_request,
    completion_parameters,
)
from services.gateway.openai_schemas import ChatBody, CompletionBody
from services.gateway.schemas import GenerateParameters
from services.gateway.state import GatewayState
from services.gateway.tgi_routes import KEEPALIVE_S, decode, gateway, prepare, until_disconnect
from services.gateway.tokenizer import TokenizerError
from services.gateway.validation import (
    ValidatedParameters,
    check_gates,
    check_lengths,
    validate_parameters,
)

T = TypeVar("T")
SERVED_MODEL_ALIASES = (None, "tgi")  # `model` values that mean "the served model"
router = APIRouter()


def envelope(state: GatewayState, model: str | None, arrived_at: float) -> Envelope:
    served = state.settings.model_id
    return Envelope(
        model=served if model in SERVED_MODEL_ALIASES else str(model),
        created=int(arrived_at),
        system_fingerprint=f"{state.version}-native",
    )


def encode_chat_prompt(state: GatewayState, prompt: str) -> list[int]:
    """Prompt ids WITHOUT added special tokens: the chat template already wrote BOS."""
    return state.tokenizer.encode(prompt, add_special_tokens=False)


async def prepare_chat(
    state: GatewayState, prompt: str, params: ValidatedParameters, arrived_at: float
) -> Prepared:
    try:
        if len(prompt) > 10_000:  # long prompts tokenize off the event loop
            input_ids = await asyncio.to_thread(encode_chat_prompt, state, prompt)
        else:
            input_ids = encode_chat_prompt(state, prompt)
    except TokenizerError as exc:
        raise ValidationError(f"tokenizer error {exc}") from exc
    max_new_tokens = check_lengths(len(input_ids), params.max_new_tokens, state.limits)
    return Prepared(prompt, input_ids, params, max_new_tokens, arrived_at)


async def generation(
    state: GatewayState,
    inputs: str,
    params: GenerateParameters,
    arrived_at: float,
    *,
    is_chat: bool,
    is_stream: bool,
) -> AsyncIterator[Token | Finished | KeepAlive]:
    """One prompt through TGI's checks and the Generator; raises GatewayError (counted)."""
    state.metrics.request_started()
    try:
        check_gates(params, state.limits, is_stream=is_stream)
        if not state.admission.try_acquire(1):
            raise overloaded()
        try:
            validated = validate_parameters(params, inputs, state.limits)
            if is_chat:
                prepared = await prepare_chat(state, inputs, validated, arrived_at)
            else:
                prepared = await prepare(state, inputs, validated, arrived_at)
            keepalive_s = KEEPALIVE_S if is_stream else None
            async for item in state.generator.stream(prepared, keepalive_s=keepalive_s):
                yield item
        finally:
            state.admission.release(1)
    except GatewayError as exc:
        state.metrics.request_failed(exc.metric_label)
        raise


async def collect(
    items: AsyncIterator[Token | Finished | KeepAlive],
) -> tuple[list[Token], Finished]:
    tokens: list[Token] = []
    async for item in items:
        if isinstance(item, Token):
            tokens.append(item)
        elif isinstance(item, Finished):
            return tokens, item
    raise incomplete_generation(is_stream=False)


async def gather_or_fail(works: list[Awaitable[T]]) -> list[T]:
    """All results in order; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failures = [t.exception() for t in tasks if t.done() and not t.cancelled()]
        first = next((exc for exc in failures if exc is not None), None)
        if first is not None:
            raise first
        return [task.result() for task in tasks]
    finally:
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:  # let them release their slots and send their aborts before answering
            await asyncio.wait(pending)


def event_stream(events: AsyncIterator[str], num_characters: int, state: GatewayState):
    headers = {
        "x-compute-type": state.compute_type,
        "x-compute-characters": str(num_characters),
        "X-Accel-Buffering": "no",
        "Cache-Control": "no-cache",
    }
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


# --- chat ------------------------------------------------------------------------------------


def render_prompt(state: GatewayState, body: ChatBody) -> str:
    if state.chat_template is None:
        raise no_template()
    return state.chat_template.render([message.for_template() for message in body.messages])


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    arrived_at, state = time.time(), gateway(request)
    body = await decode(state, request, ChatBody)
    if isinstance(body, Response):
        return body
    return await answer_chat(state, request, body, arrived_at)


async def answer_chat(
    state: GatewayState, request: Request, body: ChatBody, arrived_at: float
) -> Response:
    """A decoded chat request's answer: JSON, or SSE when `stream` (also used by /vertex)."""
    state.metrics.request_started()  # TGI counts a chat request twice (quirk)
    try:
        check_chat_request(body)
        prompt = render_prompt(state, body)
    except GatewayError as exc:
        state.metrics.request_failed(exc.metric_label)
        return exc.response()
    params = chat_parameters(body)
    meta = envelope(state, body.model, arrived_at)
    has_logprobs = bool(body.logprobs)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = chat_events(state, meta, prompt, params, arrived_at, has_logprobs, include_usage)
        return event_stream(events, len(prompt), state)
    items = generation(state, prompt, params, arrived_at, is_chat=True, is_stream=False)
    try:
        result = await until_disconnect(request, collect(items))
    except GatewayError as exc:
        return exc.response()
    if result is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    tokens, finished = result
    return JSONResponse(
        chat_completion(meta, tokens, finished, has_logprobs),
        headers=timing_headers(finished, state.compute_type, len(prompt)),
    )


async def chat_events(
    state: GatewayState,
    meta: Envelope,
    prompt: str,
    params: GenerateParameters,
    arrived_at: float,
    has_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    """One chunk per token (finish_reason on the last), the usage chunk if asked, [DONE]."""
    is_closed = False  # a token chunk carried finish_reason
    try:
        items = generation(state, prompt, params, arrived_at, is_chat=True, is_stream=True)
        async for item in items:
            if isinstance(item, KeepAlive):
                yield ":\n\n"
            elif isinstance(item, Token):
                is_closed = item.finished is not None
                yield sse(chat_chunk(meta, item, item.finished, has_logprobs))
            else:
                if not is_closed:  # a finish without a token: close the choice anyway
                    yield sse(chat_chunk(meta, None, item, has_logprobs))
                if include_usage:
                    yield sse(chat_usage_chunk(meta, item))
    except GatewayError as exc:
        yield sse(stream_error(exc))
    yield DONE


# --- completions -----------------------------------------------------------------------------


def check_completion_request(state: GatewayState, body: CompletionBody) -> None:
    if body.suffix is not None:
        raise GatewayError(
            422,
            "Suffix is not supported and can be achieved by preprocessing the prompt.",
            "suffix not supported",
            "validation",
        )
    limit = state.settings.max_client_batch_size
    if len(body.prompts) > limit:
        raise GatewayError(
            422,
            f"Number of prompts exceeds the maximum allowed batch size of {limit}",
            "batch size exceeded",
            "validation",
        )


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    arrived_at, state = time.time(), gateway(request)
    body = await decode(state, request, CompletionBody)
    if isinstance(body, Response):
        return body
    state.metrics.request_started()  # TGI counts the request, then each prompt (quirk)
    try:
        check_completion_request(state, body)
    except GatewayError as exc:
        state.metrics.request_failed(exc.metric_label)
        return exc.response()
    prompts, params = body.prompts, completion_parameters(body)
    meta = envelope(state, None, arrived_at)  # completions always answer the served id
    num_characters = sum(len(prompt) for prompt in prompts)
    if body.stream:
        events = completion_events(state, meta, prompts, params, arrived_at)
        return event_stream(events, num_characters, state)
    runs = [
        collect(generation(state, prompt, params, arrived_at, is_chat=False, is_stream=False))
        for prompt in prompts
    ]
    try:
        results = await until_disconnect(request, gather_or_fail(runs))
    except GatewayError as exc:
        return exc.response()
    if results is None:
        return Response(status_code=499)
    headers = summed_headers([f for _, f in results], state.compute_type, num_characters)
    return JSONResponse(completion(meta, results), headers=headers)


_END = object()  # a prompt's generation is over


async def completion_events(
    state: GatewayState,
    meta: Envelope,
    prompts: list[str],
    params: GenerateParameters,
    arrived_at: float,
) -> AsyncIterator[str]:
    """Chunks of all prompts, interleaved as they come; the first failure ends the stream."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def run(index: int, prompt: str) -> None:
        try:
            items = generation(state, prompt, params, arrived_at, is_chat=False, is_stream=True)
            async for item in items:
                if not isinstance(item, KeepAlive):
                    queue.put_nowait((index, item))
        except Exception as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, _END))

    tasks = [asyncio.ensure_future(run(i, prompt)) for i, prompt in enumerate(prompts)]
    num_running, closed = len(tasks), set()
    try:
        while num_running:
            try:
                index, item = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except TimeoutError:
                yield ":\n\n"
                continue
            if item is _END:
                num_running -= 1
            elif isinstance(item, GatewayError):
                yield sse(stream_error(item))
                break
            elif isinstance(item, Exception):
                raise item
            elif isinstance(item, Token):
                if item.finished is not None:
                    closed.add(index)
                yield sse(completion_chunk(meta, index, visible_text(item), item.finished))
            elif isinstance(item, Finished) and index not in closed:
                yield sse(completion_chunk(meta, index, "", item))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)  # their slots are released and aborts sent
    yield DONE


# --- models ----------------------------------------------------------------------------------


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    """The served model, OpenAI-style (not protected by --api-key, as in TGI)."""
    model_id = gateway(request).settings.model_id
    return JSONResponse(
        {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": model_id}],
        }
    )
