"""The OpenAI-compatible routes: POST /v1/chat/completions, POST /v1/completions (GET
/v1/models and the LoRA adapter routes are in models.py).

A request is admitted whole before any answer starts: its shape, the OpenAI rules (n, best_of,
echo, logprobs, logit_bias), the chat template, TGI's parameter validation and length rules
for each prompt, then one concurrency slot per generation, all or none. Whatever fails there
is an HTTP error in OpenAI's shape (400, 401, 429, ...), streaming or not; only what happens
during generation is reported inside a stream. Chat prompts come from the model's chat
template and are tokenized without special tokens (the template has them); completion
prompts get BOS like /generate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from services.gateway.openai.errors import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    body_error_response,
    gateway_error_response,
    unauthorized_response,
)
from services.gateway.openai.format import (
    Envelope,
    chat_choice,
    completion_choice,
    completion_logprobs,
    response_id,
    summed_usage,
)
from services.gateway.openai.params import (
    Fanout,
    OpenAISampling,
    body_constraint,
    chat_parameters,
    check_chat_request,
    check_completion_request,
    completion_parameters,
    openai_sampling,
)
from services.gateway.openai.schemas import ChatBody, CompletionBody
from services.gateway.openai.streams import chat_events, completion_events
from services.gateway.openai.tool_calls import ToolCallStream, parser_for_template
from services.gateway.openai.tool_calls import parse as parse_tool_calls
from services.gateway.openai.tools import (
    ToolPlan,
    plan_tools,
    template_messages,
    tool_error,
    with_tool_prompt,
)
from services.gateway.pipeline.adapters import resolve as resolve_adapter
from services.gateway.pipeline.admission import Admitted, admit
from services.gateway.pipeline.auth import is_authorized
from services.gateway.pipeline.body import BodyError, read_json
from services.gateway.pipeline.chat_template import no_template
from services.gateway.pipeline.errors import GatewayError
from services.gateway.pipeline.fanout import Item, collect, gather_or_fail
from services.gateway.pipeline.results import Finished, Prepared, Token
from services.gateway.state import GatewayState
from services.gateway.tgi.formatting import (
    mean_logprob,
    stream_headers,
    summed_headers,
    timing_headers,
)
from services.gateway.tgi.routes import KEEPALIVE_S, Answer, gateway, until_disconnect
from services.gateway.tgi.schemas import GenerateParameters
from shared.messages import AdapterRef

log = logging.getLogger(__name__)
SERVED_MODEL_ALIASES = (None, "tgi")  # `model` values that mean "the served model"
router = APIRouter()


class EventStream(StreamingResponse):
    """SSE whose `on_close` runs however the response ends: streamed to its end, cut by the
    client, or never started (a client gone before the first byte)."""

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str], on_close: Callable):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def decode_openai(
    state: GatewayState, request: Request, model: type[BaseModel]
) -> BaseModel | Response:
    """The request body as `model`, or the OpenAI-shaped error response (401, 4xx)."""
    if not is_authorized(state.settings.api_key, request.headers.get("authorization")):
        state.metrics.request_unauthorized()
        return unauthorized_response()
    try:
        return await read_json(request, model, state.settings.payload_limit)
    except BodyError as exc:
        return body_error_response(exc)


def envelope(
    state: GatewayState, model: str | None, arrived_at: float, prefix: str, has_usage_chunk: bool
) -> Envelope:
    served = state.settings.model_id
    return Envelope(
        id=response_id(prefix),
        model=served if model in SERVED_MODEL_ALIASES else str(model),
        created=int(arrived_at),
        system_fingerprint=f"{state.version}-native",
        has_usage_chunk=has_usage_chunk,
    )


async def run(
    state: GatewayState, prepared: Prepared, keepalive_s: float | None
) -> AsyncIterator[Item]:
    """One generation's items; a failure is counted, then raised."""
    state.metrics.request_started()
    with failures_counted(state):
        async for item in state.generations().stream(prepared, keepalive_s=keepalive_s):
            yield item


async def run_all(
    state: GatewayState, request: Request, generations: list[Prepared]
) -> list[tuple[list[Token], Finished]] | None:
    """Every generation's tokens and end, in order; None when the client went away."""
    return await until_disconnect(
        request, gather_or_fail([collect(run(state, p, None)) for p in generations])
    )


async def admit_openai(
    state: GatewayState,
    route: str,
    meta: Envelope,
    fanout: Fanout,
    prompts: list[str],
    choice_params: list[GenerateParameters],
    extra: OpenAISampling,
    arrived_at: float,
    ignore_eos: bool = False,
    adapter: AdapterRef | None = None,
) -> Admitted:
    """The request through the one admission path (services/gateway/pipeline/admission.py); a chat
    prompt without added special tokens (its template wrote them)."""
    admitted = await admit(
        state,
        prompts,
        choice_params,
        arrived_at,
        add_special_tokens=route != "chat",
        sampling_overrides=dataclasses.asdict(extra),
        response_id=meta.id,
        ignore_eos=ignore_eos,
        adapter=adapter,
    )
    num = len(admitted.generations)
    state.metrics.openai_generations.labels(route).observe(num)
    log.debug(
        "%s %s: %d generation(s), n=%d best_of=%d", route, meta.id, num, fanout.n, fanout.best_of
    )
    return admitted


@contextlib.contextmanager
def failures_counted(state: GatewayState) -> Iterator[None]:
    """A request refused inside counts in tgi_request_failure{err}."""
    try:
        yield
    except GatewayError as exc:
        state.metrics.request_failed(exc.metric_label)
        raise


def wants_usage_chunk(body: ChatBody | CompletionBody) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


# --- chat ------------------------------------------------------------------------------------


def render_prompt(state: GatewayState, body: ChatBody, plan: ToolPlan) -> str:
    """The chat template's prompt, tools included: handed to a template that shows them, else
    appended to the last message with TGI's tool prompt."""
    if state.chat_template is None:
        raise no_template()
    messages = template_messages(body)
    if plan.tools and not state.chat_template.shows_tools:
        return state.chat_template.render(with_tool_prompt(messages, plan.tools, body.tool_prompt))
    return state.chat_template.render(messages, plan.tools)


async def handle_openai(
    request: Request, model: type[BaseModel], answer: Answer, fields: dict[str, str]
) -> Response:
    """An OpenAI route: its arrival time, the key and the body, then `answer` (state,
    request, body, arrived_at); whatever refuses it is answered in OpenAI's error shape."""
    arrived_at, state = time.time(), gateway(request)
    body = await decode_openai(state, request, model)
    if isinstance(body, Response):
        return body
    try:
        return await answer(state, request, body, arrived_at)
    except GatewayError as exc:
        return gateway_error_response(exc, fields)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await handle_openai(request, ChatBody, answer_chat, CHAT_FIELDS)


async def answer_chat(
    state: GatewayState, request: Request, body: ChatBody, arrived_at: float
) -> Response:
    """A decoded chat request's answer: JSON, or SSE when `stream` (also used by /vertex).
    Raises GatewayError when it is not admitted."""
    state.metrics.request_started()  # TGI counts a chat request, then its generation (quirk)
    meta = envelope(state, body.model, arrived_at, "chatcmpl", wants_usage_chunk(body))
    with failures_counted(state):
        adapter = await resolve_adapter(state, body.model, strict=True)
        fanout = check_chat_request(body)
        plan = plan_tools(body)
        constraint = body_constraint(body)
        if plan.mode != "none" and constraint is not None:
            raise tool_error("Grammar and tools are mutually exclusive")
        prompt = render_prompt(state, body, plan)
        extra = openai_sampling(
            body.presence_penalty,
            body.logit_bias,
            state.tokenizer.vocab_size,
            plan.constraint or constraint,
        )
        params = fanout.choice_parameters(chat_parameters(body))
        admitted = await admit_openai(
            state,
            "chat",
            meta,
            fanout,
            [prompt],
            params,
            extra,
            arrived_at,
            body.ignore_eos,
            adapter,
        )
    generations, held = admitted.generations, admitted.held
    stop, has_logprobs = generations[0].params.stop, bool(body.logprobs)
    source = state.chat_template.source if state.chat_template else None
    parser = parser_for_template(source, state.settings.tool_call_parser)
    if body.stream:
        streams = [run(state, p, KEEPALIVE_S) for p in generations]
        readers = [ToolCallStream(plan, parser) for _ in generations]
        events = chat_events(meta, streams, stop, has_logprobs, KEEPALIVE_S, readers)

        def on_close() -> None:
            held.release()
            state.metrics.num_tool_calls[plan.mode] += sum(r.num_calls for r in readers)

        return EventStream(events, stream_headers(state.compute_type, len(prompt)), on_close)
    try:
        results = await run_all(state, request, generations)
    finally:
        held.release()
    if results is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    read = functools.partial(parse_tool_calls, plan, parser) if plan.reads_calls else None
    choices = [
        chat_choice(index, tokens, finished, has_logprobs, read)
        for index, (tokens, finished) in enumerate(results)
    ]
    num_calls = sum(len(c["message"].get("tool_calls", [])) for c in choices)
    state.metrics.num_tool_calls[plan.mode] += num_calls
    ended = [finished for _, finished in results]
    headers = (
        timing_headers(ended[0], state.compute_type, len(prompt))
        if len(ended) == 1
        else summed_headers(ended, state.compute_type, len(prompt))
    )
    answer = meta.answer("chat.completion", choices, summed_usage(ended[:1], ended))
    return JSONResponse(answer, headers=headers)


# --- completions -----------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await handle_openai(request, CompletionBody, answer_completions, COMPLETION_FIELDS)


async def answer_completions(
    state: GatewayState, request: Request, body: CompletionBody, arrived_at: float
) -> Response:
    state.metrics.request_started()  # TGI counts the request, then each generation (quirk)
    prompts = body.prompts
    with failures_counted(state):
        adapter = await resolve_adapter(state, body.model, strict=True)
        # the served id, or the adapter's name
        name = adapter.name if adapter else None
        meta = envelope(state, name, arrived_at, "cmpl", wants_usage_chunk(body))
        fanout = check_completion_request(body, state.settings.max_client_batch_size)
        extra = openai_sampling(
            body.presence_penalty,
            body.logit_bias,
            state.tokenizer.vocab_size,
            body_constraint(body),
        )
        params = fanout.choice_parameters(completion_parameters(body))
        admitted = await admit_openai(
            state,
            "completions",
            meta,
            fanout,
            prompts,
            params,
            extra,
            arrived_at,
            body.ignore_eos,
            adapter,
        )
    generations, held = admitted.generations, admitted.held
    num_characters = sum(len(prompt) for prompt in prompts)
    stop = generations[0].params.stop
    if body.stream:
        streams = [run(state, p, KEEPALIVE_S) for p in generations]
        events = completion_events(
            meta, streams, prompts, stop, body.logprobs, body.echo, KEEPALIVE_S
        )
        return EventStream(events, stream_headers(state.compute_type, num_characters), held.release)
    try:
        results = await run_all(state, request, generations)
    finally:
        held.release()
    if results is None:
        return Response(status_code=499)
    choices = []
    for prompt_index, prompt in enumerate(prompts):
        candidates = results[prompt_index * fanout.best_of : (prompt_index + 1) * fanout.best_of]
        if fanout.best_of > fanout.n:  # the n best mean logprobs, best first
            candidates = sorted(candidates, key=lambda c: mean_logprob(c[0]), reverse=True)
        for number, (tokens, finished) in enumerate(candidates[: fanout.n]):
            prefix = prompt if body.echo else ""
            logprobs = None if body.logprobs is None else completion_logprobs(tokens, len(prefix))
            text = prefix + finished.text_before_stop
            index = prompt_index * fanout.n + number
            choices.append(completion_choice(index, text, logprobs, finished))
    ended = [finished for _, finished in results]
    firsts = ended[:: fanout.best_of]  # each prompt once
    headers = summed_headers(ended, state.compute_type, num_characters)
    answer = meta.answer("text_completion", choices, summed_usage(firsts, ended))
    return JSONResponse(answer, headers=headers)
