"""The scheduler's Redis loop.

Pulls GenerateRequests from {ns}:requests (consumer group "schedulers") only while its worker
group has room, so load spreads over groups with no router; hears AbortRequests on
{ns}:aborts; sends each StepPlan to {ns}:group:{g}:steps and waits for the StepResult on
{ns}:group:{g}:results. A request is acknowledged (XACK, then XDEL) only when it ended, so the
stream holds exactly the unfinished requests and a dead scheduler's requests stay pending.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
import redis.asyncio as aioredis

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import RequestStatus, SchedRequest
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.bus import ensure_group, entry_message, get_message, read_stream, stream_fields
from shared.channels import SCHEDULER_GROUP, Channels
from shared.codec import decode, encode
from shared.messages import (
    AbortRequest,
    GenerateRequest,
    ReplyBatch,
    StepPlan,
    StepResult,
    TokenEvent,
    WorkerReady,
)
from shared.settings import Settings
from shared.telemetry import record_span, tracer

log = logging.getLogger(__name__)

STEPS_MAXLEN = 1000
STATS_INTERVAL_S = 0.25
DRAIN_CHECK_INTERVAL_S = 0.5  # how often the drain key ({ns}:group:{g}:drain) is read
RESULT_WARN_S = 30.0


class SchedulerService:
    def __init__(self, settings: Settings, redis: aioredis.Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.channels = Channels(settings.namespace)
        self.group = settings.group
        self.consumer = f"{settings.group}-{uuid.uuid4().hex[:8]}"
        self.metrics = SchedulerMetrics()
        self.tracer = tracer("textgen.scheduler")
        self.scheduler: Scheduler | None = None
        self.recent_aborts: dict[str, float] = {}  # request_id -> unix s heard
        self.draining = False
        self.stop_at: float | None = None  # unix s; set by request_stop()
        self._results_last_id = b"0-0"
        self._stats_at = 0.0
        self._drain_checked_at = 0.0  # time.monotonic() of the last read of the drain key
        self._num_preempted_seen = 0

    async def wait_for_worker(self) -> WorkerReady:
        key = self.channels.worker(self.group)
        while True:
            ready = await get_message(self.redis, key, WorkerReady)
            if ready is not None:
                return ready
            await asyncio.sleep(0.2)

    async def run(self) -> None:
        ready = await self.wait_for_worker()
        config = SchedulerConfig(
            num_blocks=ready.num_blocks,
            block_size=ready.block_size,
            max_batch_prefill_tokens=self.settings.max_batch_prefill_tokens,
            max_batch_size=min(self.settings.max_batch_size, ready.max_batch_size),
            watermark_blocks=max(1, ready.num_blocks // 100),
        )
        self.scheduler = Scheduler(config, clock=time.time)
        self.metrics.kv_blocks.set(ready.num_blocks)
        await ensure_group(self.redis, self.channels.requests, SCHEDULER_GROUP)
        await self.redis.delete(self.channels.results(self.group))
        log.info(
            "scheduler %s drives group %s (%d blocks x %d tokens)",
            self.consumer,
            self.group,
            ready.num_blocks,
            ready.block_size,
        )
        listener = asyncio.create_task(self._listen_aborts())
        try:
            await self._loop()
        finally:
            listener.cancel()

    async def _loop(self) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        while True:
            if self.stop_at is not None:
                is_over = scheduler.num_unfinished == 0 or time.time() >= self.stop_at
                scheduler.withdraw(only_waiting=not is_over)
                await self._finish_ended()
                if is_over:
                    log.info("stopped")
                    return
            await self._check_drain()
            await self._pull(block=scheduler.num_unfinished == 0)
            self._apply_aborts()
            scheduler.expire()
            plan = scheduler.schedule()
            await self._finish_ended()
            if plan is not None:
                result = await self._run_step(plan)
                scheduler.update(result)
                await self._finish_ended()
            await self._publish_stats()

    def request_stop(self) -> None:
        """SIGTERM: pull nothing more, let running requests finish for the grace period, then
        hand the rest back to the stream (see _hand_back)."""
        if self.stop_at is None:
            self.stop_at = time.time() + self.settings.shutdown_grace
            log.info(
                "stopping: finishing running requests for up to %.0f s",
                self.settings.shutdown_grace,
            )

    async def _hand_back(self, requests: list[SchedRequest]) -> None:
        """Requeue requests with the tokens they already have, so another group continues
        each stream where it stopped (the gateway skips the indexes it delivered)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for request in requests:
                resumed = msgspec.structs.replace(
                    request.message, generated_ids=request.token_ids[request.num_prompt_tokens :]
                )
                pipe.xadd(self.channels.requests, stream_fields(resumed))
            await pipe.execute()
        self.metrics.handed_back.inc(len(requests))
        log.info("handed back %d requests", len(requests))

    async def _check_drain(self) -> None:
        """Follow the drain key (`textgen queue drain GROUP`), read at most every
        DRAIN_CHECK_INTERVAL_S: while it exists, pull nothing new but finish what is held."""
        now = time.monotonic()
        if now - self._drain_checked_at < DRAIN_CHECK_INTERVAL_S:
            return
        self._drain_checked_at = now
        draining = bool(await self.redis.exists(self.channels.drain(self.group)))
        if draining != self.draining:
            self.draining = draining
            self._stats_at = 0.0  # publish the new state on this iteration
            log.info(
                "group %s %s",
                self.group,
                "draining: pulling no new requests"
                if draining
                else "undrained: pulling requests again",
            )

    async def _pull(self, block: bool) -> None:
        """XREADGROUP as many requests as the group has room for."""
        scheduler = self.scheduler
        assert scheduler is not None
        room = scheduler.config.max_batch_size - scheduler.num_unfinished
        if room <= 0 or self.draining or self.stop_at is not None:
            if block:
                await asyncio.sleep(0.1)
            return
        reply = await self.redis.xreadgroup(
            SCHEDULER_GROUP,
            self.consumer,
            {self.channels.requests: ">"},
            count=room,
            block=1000 if block else None,
        )
        now = time.time()
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                try:
                    message = entry_message(fields, GenerateRequest)
                except Exception as exc:  # a malformed entry must not stop the group
                    log.error("dropping malformed request entry %s: %s", entry_id, exc)
                    await self._ack([entry_id])
                    continue
                if message.request_id in self.recent_aborts or (
                    message.deadline and message.deadline < now
                ):
                    await self._ack([entry_id])
                    continue
                self.metrics.pulled.inc()
                scheduler.add(message, entry_id)

    async def _run_step(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        await self.redis.xadd(
            self.channels.steps(self.group),
            stream_fields(plan),
            maxlen=STEPS_MAXLEN,
            approximate=True,
        )
        self.metrics.batch_size.observe(len(plan.new_requests) + len(plan.running))
        self.metrics.admitted.inc(len(plan.new_requests))
        self.metrics.step_tokens.observe(
            sum(r.num_scheduled_tokens for r in plan.new_requests)
            + sum(r.num_scheduled_tokens for r in plan.running)
        )
        results = self.channels.results(self.group)
        waited = 0.0
        while True:
            entries = await read_stream(
                self.redis, results, self._results_last_id, StepResult, block_ms=1000
            )
            for entry_id, result in entries:
                self._results_last_id = entry_id
                if result.step_id == plan.step_id:
                    self.metrics.step_round_trip.observe(time.perf_counter() - started)
                    return result
            if not entries:
                if self.stop_at is not None and time.time() >= self.stop_at:
                    log.warning("stopping without the result of step %d", plan.step_id)
                    return StepResult(step_id=plan.step_id)  # its requests are handed back
                waited += 1.0
                if waited % RESULT_WARN_S == 0:
                    log.warning("no result for step %d after %.0f s", plan.step_id, waited)

    async def _finish_ended(self) -> None:
        """Acknowledge ended requests; tell gateways about the ones the scheduler failed."""
        scheduler = self.scheduler
        assert scheduler is not None
        ended = scheduler.take_ended()
        if not ended:
            return
        handed_back = [r for r in ended if r.status == RequestStatus.HANDED_BACK]
        if handed_back:
            await self._hand_back(handed_back)  # requeue first: nothing is lost in between
        await self._ack([r.entry_id for r in ended])
        failed = [r for r in ended if r.error]
        now = time.time()
        for request in ended:
            self.metrics.ended.labels(request.status.name.lower()).inc()
            self._trace(request, now)
            log.debug("request %s ended: %s", request.request_id, request.status.name)
        if failed:
            await self._publish_errors(failed)

    @staticmethod
    def _trace(request: SchedRequest, now: float) -> None:
        """Spans of one ended request: its wait in the queue, and its life in the scheduler."""
        traceparent = request.message.traceparent
        admitted_at = request.scheduled_at or now
        record_span("scheduler.queue_wait", traceparent, request.message.created_at, admitted_at)
        record_span(
            "scheduler.request",
            traceparent,
            request.pulled_at,
            now,
            {
                "request_id": request.request_id,
                "status": request.status.name.lower(),
                "num_generated_tokens": request.num_generated_ids,
            },
        )

    async def _publish_errors(self, failed: list[SchedRequest]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for request in failed:
                log.warning("request %s failed: %s", request.request_id, request.error)
                event = TokenEvent(
                    request_id=request.request_id, error=request.error, error_type="generation"
                )
                pipe.publish(request.message.reply_to, encode(ReplyBatch(events=[event])))
            await pipe.execute()

    async def _ack(self, entry_ids: list[bytes]) -> None:
        entry_ids = [e for e in entry_ids if e != b"0-0"]
        if not entry_ids:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(self.channels.requests, SCHEDULER_GROUP, *entry_ids)
            pipe.xdel(self.channels.requests, *entry_ids)
            await pipe.execute()

    def _apply_aborts(self) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        horizon = time.time() - self.settings.request_timeout
        for request_id, heard_at in list(self.recent_aborts.items()):
            if heard_at < horizon:
                del self.recent_aborts[request_id]
            elif scheduler.abort(request_id):
                log.debug("aborted %s", request_id)

    async def _listen_aborts(self) -> None:
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(self.channels.aborts)
        async for message in pubsub.listen():
            if message.get("type") != "message":
                continue
            try:
                abort = decode(message["data"], AbortRequest)
            except Exception as exc:
                log.warning("malformed abort message: %s", exc)
                continue
            self.recent_aborts[abort.request_id] = time.time()

    async def _publish_stats(self) -> None:
        """Throttled while busy; always when idle, so the last state is never stale."""
        now = time.time()
        scheduler = self.scheduler
        assert scheduler is not None
        if now - self._stats_at < STATS_INTERVAL_S and scheduler.num_unfinished:
            return
        self._stats_at = now
        stats = scheduler.stats(self.group, self.draining)
        self.metrics.running.set(stats.num_running)
        self.metrics.waiting.set(stats.num_waiting)
        self.metrics.kv_blocks_used.set(stats.num_blocks - stats.num_free_blocks)
        self.metrics.preempted.inc(stats.num_preempted - self._num_preempted_seen)
        self._num_preempted_seen = stats.num_preempted
        await self.redis.set(self.channels.scheduler_stats(self.group), encode(stats))
