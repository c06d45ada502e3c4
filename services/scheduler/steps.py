"""The scheduler's side of the step streams: plans out on {textgen:group:<g>}:steps, results back
on {textgen:group:<g>}:results, with up to STEPS_IN_FLIGHT plans outstanding (overlapped
scheduling: plan N+1 is sent while the worker runs plan N).

Late planning: plan N+1 only needs to reach the worker before step N ends, and a request that
arrives before it is planned starts one step sooner (its first token comes after the rest of
step N and its own step N+1, not after N, N+1 and N+2). So while the worker runs a step, the
service waits for arrivals until PLAN_AHEAD_FRACTION of a decode step's usual duration has
passed (`plan_wait_s`), then plans; an arrival ends the wait at once. Decode steps shorter than
LATE_PLANNING_MIN_STEP_S (a GPU's) are planned at once."""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.typing import KeyT, StreamIdT

from services.scheduler.metrics import SchedulerMetrics
from shared.bus import read_stream, stream_entries, stream_fields
from shared.channels import Channels
from shared.messages import StepPlan, StepResult

log = logging.getLogger(__name__)

STEPS_IN_FLIGHT = 2  # plans sent before the oldest result is awaited
STEPS_MAXLEN = 1000
RESULT_WARN_S = 30.0
# a result read waits this long before the worker's health (and where Redis's master is) is
# checked: a sentinel switch is followed within it
RESULT_BLOCK_MS = 250
# late planning: the next plan is made by this share of a decode-only step's usual duration
# (the estimate runs low on purpose: every step with prompt tokens takes longer, and a plan
# that comes late idles the worker)
PLAN_AHEAD_FRACTION = 0.6
# ...and only where decode steps take this long: the wait is a blocking read that Redis ends on
# its whole-millisecond clock (plus a wake-up command), so with the short steps of a GPU the
# plan came after the step it should follow (H200, 1B model, 2.4 ms steps: +0.97 ms per token
# against the in-process engine; simulated 2.4 ms steps here: the worker waited 0.95 ms for
# 60% of its plans)
LATE_PLANNING_MIN_STEP_S = 0.010
DECODE_STEP_SMOOTHING = 0.2  # weight of the newest decode-only step in the running estimate


class StepChannel:
    def __init__(
        self, redis: aioredis.Redis, channels: Channels, group: str, metrics: SchedulerMetrics
    ) -> None:
        self.redis = redis
        self.channels = channels
        self.group = group
        self.metrics = metrics
        self.in_flight: deque[tuple[int, float]] = deque()  # (step_id, perf_counter sent)
        self._results: dict[int, StepResult] = {}  # read ahead of their turn
        self._last_id = b"0-0"
        self._is_decode_only: dict[int, bool] = {}  # step in flight -> one token per request
        self.running_since = 0.0  # perf_counter s the oldest step in flight began on the worker
        self.decode_step_s = 0.0  # running estimate of a decode-only step's duration (0: none)
        self.session = ""  # this session's tag on its plans (reset draws a new one)

    @property
    def has_room(self) -> bool:
        return len(self.in_flight) < STEPS_IN_FLIGHT

    async def reset(self) -> None:
        """A new session: forget outstanding plans and old results. The worker may still
        answer plans of the last session after this (their step ids come again in this one):
        results of another session are dropped by their tag."""
        self.session = uuid.uuid4().hex[:12]
        await self.redis.delete(self.channels.results(self.group))
        self._last_id = b"0-0"
        self.in_flight.clear()
        self._results.clear()
        self._is_decode_only.clear()

    async def send(self, plan: StepPlan) -> None:
        """XADD a plan for the worker; its result is awaited later (await_oldest). When this
        plan fills the steps in flight, the oldest result is awaited next: the same round trip
        then also blocks (up to RESULT_BLOCK_MS) for results, which await_oldest finds read."""
        plan.session = self.session
        if not self.in_flight:  # the worker is idle: it starts this plan on receipt
            self.running_since = time.perf_counter()
        self.in_flight.append((plan.step_id, time.perf_counter()))
        scheduled = [r.num_scheduled_tokens for r in plan.new_requests + plan.running]
        self._is_decode_only[plan.step_id] = bool(scheduled) and max(scheduled) == 1
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(
                self.channels.steps(self.group),
                stream_fields(plan),
                maxlen=STEPS_MAXLEN,
                approximate=True,
            )
            if not self.has_room:
                results: dict[KeyT, StreamIdT] = {self.channels.results(self.group): self._last_id}
                pipe.xread(results, block=RESULT_BLOCK_MS)
            replies = await pipe.execute()
        if len(replies) > 1:
            self._keep_results(stream_entries(replies[1], StepResult))
        self.metrics.batch_size.observe(len(plan.new_requests) + len(plan.running))
        self.metrics.admitted.inc(len(plan.new_requests))
        self.metrics.step_tokens.observe(
            sum(r.num_scheduled_tokens for r in plan.new_requests)
            + sum(r.num_scheduled_tokens for r in plan.running)
        )

    async def await_oldest(
        self, check_worker: Callable[[], Awaitable[None]], give_up: Callable[[], bool]
    ) -> StepResult:
        """The result of the oldest plan in flight. After every silent RESULT_BLOCK_MS,
        `check_worker` may raise (the worker is gone, Redis's master moved); once `give_up()`
        is true an empty result is returned."""
        step_id, sent_at = self.in_flight.popleft()
        results = self.channels.results(self.group)
        waited = 0.0
        while step_id not in self._results:
            entries = await read_stream(
                self.redis, results, self._last_id, StepResult, block_ms=RESULT_BLOCK_MS
            )
            self._keep_results(entries)
            if not entries:
                await check_worker()
                if give_up():
                    log.warning("stopping without the result of step %d", step_id)
                    return StepResult(step_id=step_id)  # its requests are handed back
                waited += RESULT_BLOCK_MS / 1000
                if waited % RESULT_WARN_S == 0:
                    log.warning("no result for step %d after %.0f s", step_id, waited)
        self.metrics.step_round_trip.observe(time.perf_counter() - sent_at)
        result = self._results.pop(step_id)
        self.running_since = time.perf_counter()  # the next plan in flight runs from now
        if self._is_decode_only.pop(step_id, False) and result.step_s > 0 and not result.error:
            if self.decode_step_s:
                self.decode_step_s += DECODE_STEP_SMOOTHING * (result.step_s - self.decode_step_s)
            else:
                self.decode_step_s = result.step_s
        return result

    def plan_wait_s(self) -> float:
        """How long to wait for arrivals before planning the next step: until
        PLAN_AHEAD_FRACTION of a decode step has passed since the step in flight began; 0
        when the worker is idle or has a plan queued, or decode steps are short (or were not
        timed yet)."""
        if len(self.in_flight) != 1 or self.decode_step_s < LATE_PLANNING_MIN_STEP_S:
            return 0.0
        plan_at = self.running_since + PLAN_AHEAD_FRACTION * self.decode_step_s
        return max(0.0, plan_at - time.perf_counter())

    def _keep_results(self, entries: list[tuple[bytes, StepResult]]) -> None:
        for entry_id, result in entries:
            self._last_id = entry_id
            if result.session != self.session:
                log.info("dropped the result of step %d of an ended session", result.step_id)
                self.metrics.stale_results.inc()
                continue
            self._results[result.step_id] = result
