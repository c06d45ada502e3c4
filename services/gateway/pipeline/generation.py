"""One generation, from a validated request to a stream of API-level tokens.

`Generator.stream()` sends the GenerateRequest (XADD on the request stream), waits for the
worker's TokenEvents (demultiplexed by ReplyRouter), turns them into text (decoding.py:
incremental detokenizing, stop strings) and yields `Token` items then one `Finished`
(results.py). It aborts the request on the bus (PUBLISH on the aborts channel) when the client
goes away, a stop string matches, or the deadline passes. /generate, /generate_stream and the
OpenAI routes all consume it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from opentelemetry import context as otel_context
from opentelemetry import trace

from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline.decoding import TextDecoder, finite
from services.gateway.pipeline.errors import (
    GatewayError,
    generation_failed,
    overloaded,
    unavailable,
)
from services.gateway.pipeline.intake import Intake
from services.gateway.pipeline.replies import RESUME, ReplyRouter
from services.gateway.pipeline.results import Finished, KeepAlive, Prepared, Token
from services.gateway.pipeline.resume import Resumer
from services.gateway.pipeline.routing import AdapterRoutes
from services.gateway.pipeline.tokenizer import TextTokenizer
from shared.bus import REDIS_FAILURES
from shared.channels import Channels
from shared.codec import encode
from shared.messages import (
    AbortRequest,
    FinishReason,
    GenerateRequest,
    StoppingParams,
    TokenEvent,
)
from shared.telemetry import inject_traceparent, tracer

log = logging.getLogger(__name__)
REDIS_TIMEOUT_S = 2.0  # a Redis call slower than this is treated as Redis being unreachable
# Intake in one round trip: the queue-length check and the XADD, atomically. KEYS: every lane,
# then the lane to add to; ARGV: the most entries the lanes may hold, the field, the message.
# Replies the new entry's id, or false when the queue is full.


class DeadlineExceeded(GatewayError):
    """No token event arrived before the request's deadline."""

    def __init__(self, timeout_s: float):
        super().__init__(
            424,
            "Request failed during generation: no result before the request deadline "
            f"({timeout_s:g} s)",
            "generation",
        )


class QueueWaitExceeded(DeadlineExceeded):
    """No worker group took the request within --max-queue-wait: the system is saturated."""

    def __init__(self, wait_s: float):
        GatewayError.__init__(
            self,
            503,
            f"Model is overloaded: no worker took the request within {wait_s:g} s",
            "overloaded",
        )


class Generator:
    """Sends requests to the schedulers and turns token events into API tokens."""

    def __init__(
        self,
        client: aioredis.Redis,
        router: ReplyRouter,
        tokenizer: TextTokenizer,
        channels: Channels,
        metrics: GatewayMetrics,
        request_timeout: float,
        max_queue_length: int,
        max_queue_wait: float | None = None,
        resume_timeout: float = 30.0,
        wait_replicas: int = 0,
    ):
        self.client = client
        self.router = router
        self.tokenizer = tokenizer
        self.channels = channels
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.max_queue_length = max_queue_length
        self.max_queue_wait = max_queue_wait  # seconds to the first event; None: the deadline
        self.intake = Intake(client, metrics, max_queue_length, wait_replicas)
        self.routes = AdapterRoutes(client, channels)  # LoRA requests to the adapter's holder
        self.resumer = Resumer(self._send, self._abort, router, metrics, resume_timeout)
        self._background: set[asyncio.Task] = set()
        self.num_queued = 0  # requests sent and waiting for their first event
        self.num_running = 0  # requests with at least one event

    async def stream(
        self, prepared: Prepared, keepalive_s: float | None = None
    ) -> AsyncIterator[Token | Finished | KeepAlive]:
        """Run one generation; raises GatewayError on failure.

        Yields each Token but the last, then one Finished holding the last token (the end,
        and the only one), and KeepAlive after `keepalive_s` of silence when asked.
        """
        request_id = uuid.uuid4().hex
        constraint = prepared.params.sampling.constraint
        span = tracer(__name__).start_span(
            "gateway.generate",
            attributes={
                "request_id": request_id,
                "num_input_tokens": len(prepared.input_ids),
                "response_id": prepared.response_id,
                "constraint": constraint.kind.value if constraint else "",
            },
        )
        queue = self.router.register(request_id)
        outcome = "dropped"  # what happened, unless the loop below says otherwise
        try:
            message = self._message(request_id, prepared, span)
            await self._send(message)
            enqueued_at = time.time()
            async for item in self._consume(queue, message, prepared, enqueued_at, keepalive_s):
                if isinstance(item, Finished):  # a consumer may stop right after it
                    outcome = "stop_sequence" if self._needs_abort(item) else "finished"
                    self._log_finished(request_id, item)
                yield item
        except GatewayError as exc:
            outcome = "deadline" if isinstance(exc, DeadlineExceeded) else "failed"
            span.set_attribute("error", exc.message)
            raise
        finally:
            # re-submitted: a copy of an earlier attempt may still run
            if self.router.unregister(request_id) and outcome == "finished":
                outcome = "resumed"
            if outcome in ("dropped", "deadline", "stop_sequence", "resumed"):
                self._abort(request_id, outcome)
            if outcome == "dropped":
                self.metrics.request_failed("dropped")
                log.info("request %s dropped by the client", request_id)
            span.end()

    def _needs_abort(self, finished: Finished) -> bool:
        return finished.finish_reason == FinishReason.STOP_SEQUENCE

    def _message(self, request_id: str, prepared: Prepared, span: trace.Span) -> GenerateRequest:
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            traceparent = inject_traceparent()
        finally:
            otel_context.detach(token)
        created_at = time.time()
        return GenerateRequest(
            request_id=request_id,
            input_ids=prepared.input_ids,
            sampling=prepared.params.sampling,
            stopping=StoppingParams(
                max_new_tokens=prepared.max_new_tokens, ignore_eos=prepared.params.ignore_eos
            ),
            reply_to=self.router.channel,
            created_at=created_at,
            deadline=created_at + self.request_timeout,
            priority=prepared.params.priority,
            traceparent=traceparent,
            adapter=prepared.adapter,
        )

    async def _send(self, message: GenerateRequest) -> None:
        if not self.router.is_subscribed:
            raise unavailable("not connected to Redis (reply channel not subscribed)")
        target = self.channels.lane(message.priority)
        if message.adapter is not None:
            holder = await self.routes.group_for(message.adapter.id)
            if holder is not None:
                target = self.channels.directed(holder)
                self.metrics.num_routed_adapter_requests += 1
                log.debug("request %s to group %s (holds its adapter)", message.request_id, holder)
        keys = [*self.channels.lanes, target]
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                entry_id = await self.intake.add(keys, encode(message))
        except REDIS_FAILURES as exc:
            raise unavailable(f"Redis unreachable ({type(exc).__name__}: {exc})") from exc
        if entry_id is None:
            raise overloaded()
        self.metrics.max_new_tokens.observe(message.stopping.max_new_tokens)

    async def _next_event(
        self,
        queue: asyncio.Queue[TokenEvent],
        deadline: float,
        keepalive_s: float | None,
        queue_deadline: float | None = None,
    ) -> TokenEvent | None:
        """The next event; None after `keepalive_s` of silence; raises at the deadline (or at
        the queue deadline, while the request still waits for a worker)."""
        if queue_deadline is not None and queue_deadline < deadline:
            try:
                return await self._next_event(queue, queue_deadline, keepalive_s)
            except DeadlineExceeded:
                raise QueueWaitExceeded(self.max_queue_wait or 0.0) from None
        remaining = deadline - time.time()
        if remaining > 0 and not queue.empty():  # the common case while streaming: no timer
            return queue.get_nowait()
        wait = remaining if keepalive_s is None else min(remaining, keepalive_s)
        try:
            if wait <= 0:
                raise TimeoutError
            async with asyncio.timeout(wait):  # unlike wait_for, no task per event
                return await queue.get()
        except TimeoutError:
            if time.time() < deadline:
                return None
            raise DeadlineExceeded(self.request_timeout) from None

    async def _consume(
        self,
        queue: asyncio.Queue[TokenEvent],
        message: GenerateRequest,
        prepared: Prepared,
        enqueued_at: float,
        keepalive_s: float | None,
    ) -> AsyncIterator[Token | Finished | KeepAlive]:
        decoder = TextDecoder(self.tokenizer, prepared)
        delivered: list[int] = []  # token ids handed on so far (a resumed copy continues them)
        scheduled_at: float | None = None
        prefill: list[Token] = []
        self._count(queued=1)
        try:
            while True:
                queue_deadline = (
                    enqueued_at + self.max_queue_wait
                    if self.max_queue_wait and scheduled_at is None
                    else None
                )
                event = await self._next_event(queue, message.deadline, keepalive_s, queue_deadline)
                if event is None:
                    yield KeepAlive()
                    continue
                if event.error_type == RESUME:  # Redis lost its events: add it again
                    async for keepalive in self.resumer.resume(message, delivered, keepalive_s):
                        yield keepalive
                    continue
                if scheduled_at is None:
                    scheduled_at = min(event.scheduled_at or time.time(), time.time())
                    self._count(queued=-1, running=1)
                if event.error:
                    raise generation_failed(event.error, event.error_type)
                if event.prefill_logprobs and not prefill:
                    prefill = self._prefill(prepared.input_ids, event.prefill_logprobs)
                delivered.extend(event.token_ids)
                for position in range(len(event.token_ids)):
                    token = decoder.token(event, position)
                    is_last = position == len(event.token_ids) - 1
                    reason = (
                        FinishReason.STOP_SEQUENCE
                        if decoder.stop_end is not None
                        else (event.finish_reason if is_last else None)
                    )
                    if reason is None:
                        yield token
                        continue
                    if reason != FinishReason.STOP_SEQUENCE:
                        token.text += decoder.flush()
                    yield self._finished(
                        decoder, prepared, reason, enqueued_at, scheduled_at, prefill, token
                    )
                    return
                if event.finish_reason is not None:  # a final event without tokens
                    decoder.flush()
                    yield self._finished(
                        decoder, prepared, event.finish_reason, enqueued_at, scheduled_at, prefill
                    )
                    return
        finally:
            self._count(
                queued=-1 if scheduled_at is None else 0, running=0 if scheduled_at is None else -1
            )

    def _prefill(self, input_ids: list[int], logprobs: list[float]) -> list[Token]:
        """TGI's `details.prefill`: each prompt token with its logprob (the first is null)."""
        return [
            Token(0, token_id, self.tokenizer.token_text(token_id), finite(logprob), False)
            for token_id, logprob in zip(input_ids, logprobs, strict=False)
        ]

    def _count(self, queued: int = 0, running: int = 0) -> None:
        self.num_queued += queued
        self.num_running += running
        self.metrics.queue_size.set(self.num_queued)
        self.metrics.batch_current_size.set(self.num_running)

    def _finished(
        self,
        decoder: TextDecoder,
        prepared: Prepared,
        reason: FinishReason,
        enqueued_at: float,
        scheduled_at: float,
        prefill: list[Token],
        last_token: Token | None = None,
    ) -> Finished:
        now = time.time()
        scheduled_at = max(scheduled_at, enqueued_at)
        finished = Finished(
            generated_text=decoder.generated_text,
            finish_reason=reason,
            num_generated_tokens=decoder.num_tokens,
            num_input_tokens=len(prepared.input_ids),
            seed=prepared.params.reported_seed,
            validation_s=enqueued_at - prepared.arrived_at,
            queue_s=scheduled_at - enqueued_at,
            inference_s=now - scheduled_at,
            total_s=now - prepared.arrived_at,
            prefill=prefill,
            stop_sequence=decoder.stop_sequence,
            last_token=last_token,
        )
        self.metrics.request_succeeded(
            total_s=finished.total_s,
            validation_s=finished.validation_s,
            queue_s=finished.queue_s,
            inference_s=finished.inference_s,
            num_input_tokens=finished.num_input_tokens,
            num_generated_tokens=finished.num_generated_tokens,
        )
        return finished

    def _log_finished(self, request_id: str, finished: Finished) -> None:
        log.info(
            "request %s finished: %s, input_tokens=%d generated_tokens=%d total=%.3fs "
            "validation=%.3fs queue=%.3fs inference=%.3fs",
            request_id,
            finished.finish_reason.value,
            finished.num_input_tokens,
            finished.num_generated_tokens,
            finished.total_s,
            finished.validation_s,
            finished.queue_s,
            finished.inference_s,
        )
        log.debug(
            "request %s generated_text=%r seed=%s",
            request_id,
            finished.generated_text[:200],
            finished.seed,
        )

    def _abort(self, request_id: str, reason: str, below_attempt: int = 0) -> None:
        """PUBLISH an AbortRequest (of the attempts below `below_attempt`, unless 0) in the
        background: the caller may be being cancelled."""
        abort = AbortRequest(request_id=request_id, reason=reason, below_attempt=below_attempt)
        task = asyncio.get_running_loop().create_task(self._publish_abort(abort))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish_abort(self, abort: AbortRequest) -> None:
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self.client.publish(self.channels.aborts, encode(abort))
        except REDIS_FAILURES as exc:
            log.warning("could not publish abort of %s: %s", abort.request_id, exc)

    async def drain(self) -> None:
        """Wait for background aborts (shutdown)."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=REDIS_TIMEOUT_S)
