"""The scheduler's loop: one session per lifetime of its worker group.

Each turn of the loop pulls requests only while the worker group has room, so load spreads
over groups with no router (intake.py: the request lanes, claims, acknowledgements);
applies the aborts heard on {textgen}:aborts; lets the Scheduler plan (scheduler.py, no I/O); sends
each StepPlan and waits for the StepResult (steps.py); and finishes the requests that ended.
A request is acknowledged only when it ended, so the lanes hold exactly the unfinished
requests and a dead scheduler's requests stay pending for another to claim.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from services.scheduler.aborts import AbortListener
from services.scheduler.config import SchedulerConfig
from services.scheduler.intake import RequestIntake, Taken
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import RequestStatus, SchedRequest
from services.scheduler.scheduler import Scheduler
from services.scheduler.steps import StepChannel
from shared.bus import REDIS_ERRORS, get_message
from shared.channels import Channels
from shared.codec import decode, encode
from shared.master_watch import Address, MasterWatch
from shared.messages import (
    ReplyBatch,
    TokenEvent,
    WorkerReady,
)
from shared.settings import Settings
from shared.telemetry import record_span, tracer

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 1.0  # between Redis retries: a failover takes seconds, follow it soon


STATS_INTERVAL_S = 0.25
DRAIN_CHECK_INTERVAL_S = 0.5  # how often the drain key ({textgen:group:<g>}:drain) is read
WORKER_CHECK_INTERVAL_S = 1.0  # how often an idle loop checks its worker's heartbeat
CLAIM_INTERVAL_S = 1.0  # how often abandoned requests are looked for
KEEP_FRESH_INTERVAL_S = 1.0  # how often held requests' idle times are reset


class WorkerLost(Exception):
    """The group's worker stopped beating or was replaced; its steps will never answer."""

    def __init__(self, reason: str, started_at: float) -> None:
        super().__init__(reason)
        self.started_at = started_at  # WorkerReady.started_at of the lost worker


class SchedulerService:
    def __init__(self, settings: Settings, redis: aioredis.Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.channels = Channels(settings.namespace)
        self.group = settings.group
        self.consumer = f"{settings.group}-{uuid.uuid4().hex[:8]}"
        self.metrics = SchedulerMetrics()
        # a new master named by the sentinels ends the session as a lost Redis does
        self.master = MasterWatch.for_settings(settings, [redis], self.metrics.master_switches.inc)
        self._master_seen = 0  # master.num_switches when the session started (or checked)
        self._session_master: Address | None = None  # the master it started on (sentinels)
        self.tracer = tracer("textgen.scheduler")
        self.scheduler: Scheduler | None = None
        self.aborts = AbortListener(redis, self.channels, settings.request_timeout, self.master)
        self.intake = RequestIntake(
            redis,
            self.channels,
            self.consumer,
            self.aborts,
            self.metrics,
            settings.claim_timeout,
            settings.group,
        )
        self.draining = False
        self.stop_at: float | None = None  # unix s; set by request_stop()
        self.steps = StepChannel(redis, self.channels, settings.group, self.metrics)
        self._worker: WorkerReady = WorkerReady(
            group="", model_id="", num_blocks=0, block_size=0, max_batch_size=0, max_model_len=0
        )
        self._lost_started_at = 0.0  # WorkerReady.started_at of the last worker lost
        self._worker_checked_at = 0.0
        self._claimed_at = 0.0
        self._stats_at = 0.0
        self._drain_checked_at = 0.0  # time.monotonic() of the last read of the drain key
        self._num_preempted_seen = 0

    async def wait_for_worker(self) -> WorkerReady | None:
        """A worker of the group that announced itself and beats (a newer one than the worker
        lost last); None if asked to stop meanwhile."""
        while self.stop_at is None:
            ready = await get_message(self.redis, self.channels.worker(self.group), WorkerReady)
            is_beating = await self.redis.exists(self.channels.heartbeat(self.group))
            if ready is not None and is_beating and ready.started_at > self._lost_started_at:
                return ready
            await asyncio.sleep(0.2)
        return None

    async def run(self) -> None:
        """Sessions, one per worker lifetime, until stopped. A lost worker hands its requests
        back; a Redis outage drops the session (its requests stay pending in the stream and
        are claimed again) and retries with backoff: nothing here crashes on Redis."""
        self.master.start()
        tasks = [
            asyncio.create_task(self.aborts.run()),
            asyncio.create_task(self._keep_fresh()),
        ]
        backoff = 0.25
        try:
            while True:
                try:
                    ready = await self.wait_for_worker()
                    if ready is None:
                        return
                    await self._start_session(ready)
                    backoff = 0.25
                    await self._loop()
                    return
                except WorkerLost as exc:
                    log.error(
                        "worker group %s lost (%s): handing its requests back", self.group, exc
                    )
                    self._lost_started_at = exc.started_at
                    await self._end_session(hand_back=True)
                except (*REDIS_ERRORS, ResponseError) as exc:
                    if not isinstance(exc, REDIS_ERRORS) and "NOGROUP" not in str(exc):
                        raise  # a bug, not an outage (a reset Redis lost the group: NOGROUP)
                    log.warning("Redis unreachable or reset (%s); retrying in %.2f s", exc, backoff)
                    self.scheduler = None  # held requests stay pending: claimed again later
                    await self.master.pause(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
        finally:
            for task in tasks:
                task.cancel()
            await self.master.stop()

    async def _start_session(self, ready: WorkerReady) -> None:
        config = SchedulerConfig.for_worker(
            ready,
            self.settings.max_batch_prefill_tokens,
            self.settings.max_batch_size,
            enable_prefix_caching=not self.settings.disable_prefix_caching,
        )
        self._master_seen = self.master.num_switches
        await self.intake.open()
        await self.steps.reset()
        # where those commands went (a sentinel-managed pool notes the master it connects to)
        pool = getattr(self.redis, "connection_pool", None)  # a cluster client has one per node
        self._session_master = getattr(pool, "master_address", None)
        self._worker = ready
        self.scheduler = Scheduler(config, clock=time.time)  # its first plan resets the worker
        await self._add(await self.intake.own_pending())
        self.metrics.kv_blocks.set(ready.num_blocks)
        log.info(
            "scheduler %s drives group %s (%d blocks x %d tokens)",
            self.consumer,
            self.group,
            ready.num_blocks,
            ready.block_size,
        )

    async def _end_session(self, hand_back: bool) -> None:
        scheduler = self.scheduler
        if scheduler is not None and hand_back:
            scheduler.withdraw(only_waiting=False)
            await self._finish_ended()
        self.scheduler = None

    async def _check_worker(self, force: bool = False) -> None:
        """Raise WorkerLost when the group's heartbeat expired or another worker replaced it;
        MasterMoved when the sentinels named another Redis master since the session began."""
        self._master_seen = self.master.check(self._master_seen, self._session_master)
        now = time.monotonic()
        if not force and now - self._worker_checked_at < WORKER_CHECK_INTERVAL_S:
            return
        self._worker_checked_at = now
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.exists(self.channels.heartbeat(self.group))
            pipe.get(self.channels.worker(self.group))
            is_beating, raw = await pipe.execute()
        started_at = self._worker.started_at
        current = decode(raw, WorkerReady) if raw else None
        if not is_beating:
            raise WorkerLost("its heartbeat expired", started_at)
        if current is not None and current.started_at != started_at:
            raise WorkerLost("a new worker replaced it", started_at)

    async def _loop(self) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        while True:
            await self._check_worker()
            if self.stop_at is not None:
                is_over = scheduler.num_unfinished == 0 or time.time() >= self.stop_at
                scheduler.withdraw(only_waiting=not is_over)
                await self._finish_ended()
                if is_over:
                    log.info("stopped")
                    return
            await self._check_drain()
            await self._claim()
            await self._pull(block=scheduler.num_unfinished == 0, wait_s=self._plan_wait_s())
            self._apply_aborts()
            scheduler.expire()
            # overlapped scheduling: plan step N+1 while the worker runs step N
            plan = scheduler.schedule() if self.steps.has_room else None
            await self._finish_ended()
            if plan is not None:
                await self.steps.send(plan)
            if self.steps.in_flight and (plan is None or not self.steps.has_room):
                result = await self.steps.await_oldest(
                    lambda: self._check_worker(force=True),
                    lambda: self.stop_at is not None and time.time() >= self.stop_at,
                )
                scheduler.update(result)
                await self._finish_ended()
            await self._publish_stats()

    def request_stop(self) -> None:
        """SIGTERM: pull nothing more, let running requests finish for the grace period, then
        hand the rest back to the stream (RequestIntake.hand_back)."""
        if self.stop_at is None:
            self.stop_at = time.time() + self.settings.shutdown_grace
            log.info(
                "stopping: finishing running requests for up to %.0f s",
                self.settings.shutdown_grace,
            )

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

    def _plan_wait_s(self) -> float:
        """Late planning (steps.py): how long the next plan may wait for an arrival; 0 unless
        the worker is busy with running requests and has no plan queued (StepChannel checks
        the plans in flight)."""
        scheduler = self.scheduler
        if scheduler is None or not scheduler.running:
            return 0.0
        return self.steps.plan_wait_s()

    async def _pull(self, block: bool, wait_s: float = 0.0) -> None:
        """Take as many requests as the group has room for (blocking for the next arrival
        when `block` and none is there; waiting up to `wait_s` for one otherwise)."""
        scheduler = self.scheduler
        assert scheduler is not None
        room = scheduler.config.max_batch_size - scheduler.num_unfinished
        if room <= 0 or self.draining or self.stop_at is not None:
            if block:
                await asyncio.sleep(0.1)
            return
        started = time.perf_counter()
        taken = await self.intake.pull(room, block, wait_s)
        if wait_s and not block:
            self.metrics.plan_wait.observe(time.perf_counter() - started)
            if taken:
                self.metrics.late_plan_arrivals.inc(len(taken))
        await self._add(taken)

    async def _add(self, taken: list[Taken]) -> None:
        """Hand `taken` to the scheduler; copies of requests it holds already (a gateway
        re-submitted them after losing Redis) are acknowledged away."""
        scheduler = self.scheduler
        assert scheduler is not None
        copies = []
        for message, entry_id, lane in taken:
            if not scheduler.add(message, entry_id, lane):
                attempt = message.attempt
                log.info("request %s: dropped a copy of attempt %d", message.request_id, attempt)
                copies.append((lane, entry_id))
        if copies:
            await self.intake.ack(copies)

    async def _claim(self) -> None:
        """Take over requests of schedulers that went silent (at most every CLAIM_INTERVAL_S)."""
        scheduler = self.scheduler
        assert scheduler is not None
        now = time.monotonic()
        room = scheduler.config.max_batch_size - scheduler.num_unfinished
        if now - self._claimed_at < CLAIM_INTERVAL_S or room <= 0 or self.draining:
            return
        self._claimed_at = now
        await self._add(await self.intake.claim(room))

    async def _keep_fresh(self) -> None:
        """Background: keep the held entries' idle time low, so nobody claims them."""
        while True:
            await asyncio.sleep(KEEP_FRESH_INTERVAL_S)
            scheduler = self.scheduler
            if scheduler is None:
                continue
            try:
                await self.intake.keep_fresh(scheduler.held_entries())
            except REDIS_ERRORS as exc:
                log.debug("could not refresh held entries: %s", exc)

    async def _finish_ended(self) -> None:
        """Acknowledge ended requests; tell gateways about the ones the scheduler failed."""
        scheduler = self.scheduler
        assert scheduler is not None
        ended = scheduler.take_ended()
        if not ended:
            return
        handed_back = [r for r in ended if r.status == RequestStatus.HANDED_BACK]
        if handed_back:  # requeue first: nothing is lost in between
            await self.intake.hand_back(handed_back)
            log.info("handed back %d requests", len(handed_back))
        await self.intake.ack((r.stream, r.entry_id) for r in ended)
        failed = [r for r in ended if r.error]
        now = time.time()
        for request in ended:
            self.metrics.ended.labels(request.status.name.lower()).inc()
            self._trace(request, now)
            level = logging.INFO if request.message.attempt else logging.DEBUG  # resumed: rare
            what = (request.request_id, request.message.attempt, request.status.name)
            log.log(level, "request %s attempt %d ended: %s", *what)
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

    def _apply_aborts(self) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        for request_id, below_attempt in self.aborts.recent():
            if scheduler.abort(request_id, below_attempt):
                log.debug("aborted %s", request_id)

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
        if stats.num_admitted_tokens:
            self.metrics.prefix_hit_rate.set(stats.num_cached_tokens / stats.num_admitted_tokens)
        self.metrics.cached_blocks.set(stats.num_cached_blocks)
        await self.redis.set(self.channels.scheduler_stats(self.group), encode(stats))
