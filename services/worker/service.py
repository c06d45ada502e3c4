"""The worker's Redis loop: announce capacity, execute step plans, stream tokens back.

Reads StepPlans from {ns}:group:{g}:steps (a background reader keeps the next ones at hand),
runs them on the ModelRunner (on the torch thread, so the heartbeat keeps beating during a long
forward; the next plan is queued there before the current step ends, so forwards run back to
back), and in one pipeline PUBLISHes one ReplyBatch per gateway and XADDs the StepResult to
{ns}:group:{g}:results, while the next step computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import redis.asyncio as aioredis

from services.worker.fake import FakeRunner, vocab_size_of
from services.worker.fallback import make_runner
from services.worker.flash_attention import flash_block_size
from services.worker.kv_cache import PagedKVCache, default_budget, plan_num_blocks
from services.worker.loader import LoadedModel
from services.worker.metrics import WorkerMetrics
from services.worker.runner import ModelRunner, StepOutcome
from shared.bus import FIELD, REDIS_ERRORS, entry_message, stream_fields
from shared.channels import Channels
from shared.codec import encode
from shared.messages import Heartbeat, ReplyBatch, StepPlan, WorkerReady
from shared.settings import Settings

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5
RESULTS_MAXLEN = 1000
TRIM_EVERY = 64  # plans read between two trims of the steps stream (a round trip each)
STEPS_HANDED_OVER = 2  # plans queued on the torch thread at once: the one computing, the next


class WorkerService:
    def __init__(
        self,
        settings: Settings,
        loaded: LoadedModel,
        redis: aioredis.Redis,
        on_plan: Callable[[StepPlan], object] | None = None,
        torch_thread: ThreadPoolExecutor | None = None,
    ) -> None:
        """Build it on `torch_thread` (it allocates the KV cache): see services/worker/main.py."""
        self.on_plan = on_plan  # tensor parallel: hands each plan to the other ranks first
        self.settings = settings
        self.loaded = loaded
        self.redis = redis
        self.channels = Channels(settings.namespace)
        self.group = settings.group
        self.metrics = WorkerMetrics()
        budget = settings.kv_cache_memory or default_budget(loaded.device)
        # never more than a full batch of full contexts could use
        max_tokens = (
            settings.max_batch_total_tokens or settings.max_batch_size * loaded.max_model_len
        )
        is_paged = loaded.runner == "paged"
        block_size = flash_block_size(
            settings.block_size, loaded.device, loaded.cache_shape, is_paged=is_paged
        )
        num_blocks = plan_num_blocks(loaded.cache_shape, block_size, budget, max_tokens)
        cache = PagedKVCache(
            loaded.cache_shape,
            num_blocks,
            block_size,
            loaded.device,
            allocate=is_paged,
        )
        self.metrics.kv_blocks.set(num_blocks)
        runner_args = (
            loaded.model,
            cache,
            loaded.eos_token_ids,
            loaded.max_model_len,
            loaded.device,
        )
        if settings.fake_step_ms is not None:
            self.runner: ModelRunner = FakeRunner(
                *runner_args, step_ms=settings.fake_step_ms, vocab_size=vocab_size_of(loaded.folder)
            )
        else:
            self.runner = make_runner(loaded, cache, settings.speculate)
        self.metrics.attention.labels(self.runner.attention).set(1)
        self.last_step_id = 0
        self.started_at = time.time()  # identifies this worker's lifetime to its scheduler
        self._ready_bytes = encode(self.ready_message())
        self.is_last_step_ok = True  # a failed step makes the group unhealthy until one succeeds
        self.stop_at: float | None = None  # unix s; set by request_stop()
        # every forward on the thread that loaded the model: see services/worker/main.py
        self._forward_thread = torch_thread or ThreadPoolExecutor(1, thread_name_prefix="torch")
        self._last_step_end: float | None = None  # perf_counter, on the torch thread

    def ready_message(self) -> WorkerReady:
        cache = self.runner.kv_cache
        return WorkerReady(
            group=self.group,
            model_id=self.settings.model_id,
            num_blocks=cache.num_blocks,
            block_size=cache.block_size,
            max_batch_size=self.settings.max_batch_size,
            max_model_len=self.loaded.max_model_len,
            eos_token_ids=self.loaded.eos_token_ids,
            dtype=str(self.loaded.cache_shape.dtype).removeprefix("torch."),
            device=str(self.loaded.device),
            world_size=self.settings.num_shard,
            num_speculative_tokens=self.runner.num_speculative_tokens,
            runner=self.loaded.runner,
            attention=self.runner.attention,
            started_at=self.started_at,
        )

    async def announce(self) -> None:
        """Drop stale plans, then publish capacity: from here on the scheduler may plan."""
        channels = self.channels
        await self.redis.delete(channels.steps(self.group))
        await self._beat()
        log.info(
            "worker group %s ready: %d blocks of %d tokens",
            self.group,
            self.runner.kv_cache.num_blocks,
            self.runner.kv_cache.block_size,
        )

    async def run(self) -> None:
        await self.announce()
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        try:
            await self._step_loop()
        finally:
            heartbeat.cancel()

    def request_stop(self) -> None:
        """SIGTERM: keep executing the scheduler's steps until no request is held (the
        scheduler finishes or hands back its requests), for at most the grace period."""
        if self.stop_at is None:
            self.stop_at = time.time() + self.settings.shutdown_grace
            log.info("stopping once idle (at most %.0f s)", self.settings.shutdown_grace)

    async def _step_loop(self) -> None:
        """Execute plans until stopped. A plan is handed to the torch thread as soon as it
        arrives, even while the step before it computes, so the thread starts it the moment
        that step ends (without waiting for this loop, which is publishing); at most
        STEPS_HANDED_OVER are handed over at once. Step N's events and result are published
        while step N+1 computes (the scheduler sent N+1 before it hears of N). A Redis outage
        pauses reading and publishing (retried with backoff; the heartbeat re-announces the
        group once Redis is back), never ends the loop, and never runs a plan twice."""
        plans: asyncio.Queue[StepPlan] = asyncio.Queue()
        reader = asyncio.create_task(self._read_plans(plans), name="plan-reader")
        computing: deque[tuple[int, asyncio.Future[StepOutcome]]] = deque()  # (step_id, step)
        unpublished: StepOutcome | None = None
        try:
            while True:
                if not computing:
                    plan = await self._next_plan(plans)
                    if plan is None:
                        return
                    computing.append(self._hand_over(plan, is_queued=False))
                await self._hand_over_arrivals(plans, computing)
                step_id, step = computing.popleft()
                unpublished = await step
                self.last_step_id = step_id
                await self._publish_until_sent(unpublished)
                unpublished = None
        finally:
            reader.cancel()
            for _, step in computing:
                step.cancel()  # one not started yet never runs
            if unpublished is not None:
                with contextlib.suppress(*REDIS_ERRORS):
                    await self._publish(unpublished)

    def _hand_over(
        self, plan: StepPlan, is_queued: bool = True
    ) -> tuple[int, asyncio.Future[StepOutcome]]:
        """Queue `plan` on the torch thread; `is_queued`: behind a step not done yet."""
        loop = asyncio.get_running_loop()
        step = loop.run_in_executor(self._forward_thread, self._execute, plan, is_queued)
        return plan.step_id, step

    async def _hand_over_arrivals(
        self,
        plans: asyncio.Queue[StepPlan],
        computing: deque[tuple[int, asyncio.Future[StepOutcome]]],
    ) -> None:
        """Until the oldest step handed over is done: hand over each plan that arrives, while
        fewer than STEPS_HANDED_OVER are."""
        oldest = computing[0][1]
        while len(computing) < STEPS_HANDED_OVER and not oldest.done() and not self._is_overdue():
            if not plans.empty():
                computing.append(self._hand_over(plans.get_nowait()))
                continue
            arrival = asyncio.ensure_future(plans.get())
            try:
                await asyncio.wait((oldest, arrival), return_when=asyncio.FIRST_COMPLETED)
            finally:
                has_arrived = arrival.done()
                if not has_arrived:
                    arrival.cancel()  # a cancelled get() takes nothing from the queue
            if has_arrived:
                computing.append(self._hand_over(arrival.result()))

    def _is_overdue(self) -> bool:
        """Stopping, and the grace period is over: no more plans are executed."""
        return self.stop_at is not None and time.time() >= self.stop_at

    async def _next_plan(self, plans: asyncio.Queue[StepPlan]) -> StepPlan | None:
        """The next plan; None once stopping is due (no requests held and no plan waiting, or
        the grace period is over)."""
        while True:
            timeout = 1.0 if self.stop_at is None else 0.25
            try:
                async with asyncio.timeout(timeout):
                    plan = await plans.get()
            except TimeoutError:
                plan = None
            is_idle = plan is None and not self.runner.requests
            if (self.stop_at is not None and is_idle) or self._is_overdue():
                log.info("stopped with %d requests held", len(self.runner.requests))
                return None
            if plan is not None:
                return plan

    async def _read_plans(self, plans: asyncio.Queue[StepPlan]) -> None:
        """Background: every plan on the steps stream, in order, into `plans`."""
        steps = self.channels.steps(self.group)
        last_id = b"0-0"
        num_untrimmed = 0  # plans read since the stream was last trimmed
        backoff = 0.25
        while True:
            try:
                reply = await self.redis.xread({steps: last_id}, block=1000)
                entries = [entry for _stream, found in reply or [] for entry in found]
                for entry_id, fields in entries:
                    last_id = entry_id
                    try:
                        plans.put_nowait(entry_message(fields, StepPlan))
                    except Exception as exc:  # a poisoned entry must not stop the worker
                        await self._dead_letter(steps, entry_id, fields, exc)
                num_untrimmed += len(entries)
                # every TRIM_EVERY plans, and once idle (an idle group leaves an empty stream)
                if num_untrimmed >= TRIM_EVERY or (num_untrimmed and not entries):
                    await self.redis.xtrim(steps, minid=last_id, approximate=True)
                    num_untrimmed = 0
                backoff = 0.25
            except REDIS_ERRORS as exc:
                log.warning("Redis unreachable (%s); retrying in %.2f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _publish_until_sent(self, outcome: StepOutcome) -> None:
        backoff = 0.25
        while True:
            try:
                await self._publish(outcome)
                return
            except REDIS_ERRORS as exc:
                log.warning("could not publish a step (%s); retrying in %.2f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _dead_letter(
        self, source: str, entry_id: bytes, fields: dict, exc: Exception
    ) -> None:
        reason = f"malformed StepPlan: {type(exc).__name__}: {exc}"
        log.error("dead-lettering entry %s of %s: %s", entry_id, source, reason)
        await self.redis.xadd(
            self.channels.dead_letters,
            {
                b"source": source.encode(),
                b"entry_id": entry_id,
                b"reason": reason.encode(),
                FIELD: fields.get(FIELD, b""),
            },
            maxlen=10_000,
            approximate=True,
        )

    def _execute(self, plan: StepPlan, is_queued: bool) -> StepOutcome:
        if is_queued and self._last_step_end is not None:
            self.metrics.step_gap.observe(time.perf_counter() - self._last_step_end)
        if self.on_plan is not None:
            self.on_plan(plan)
        outcome = self.runner.execute(plan)  # per-request spans: see ModelRunner
        result = outcome.result
        self.metrics.step_duration.observe(result.step_s)
        self.metrics.forward_duration.observe(result.forward_s)
        self.metrics.sample_duration.observe(result.sample_s)
        if result.step_s > 0:
            self.metrics.tokens_per_s.set(result.num_tokens / result.step_s)
        self.metrics.batch_tokens.observe(result.num_tokens)
        self.metrics.generated_tokens.inc(sum(len(o.token_ids) for o in result.outputs))
        self.metrics.draft_tokens.inc(result.num_draft_tokens)
        self.metrics.accepted_tokens.inc(result.num_accepted_tokens)
        self.metrics.requests.set(len(self.runner.requests))
        if result.error:
            self.metrics.step_failures.inc()
        if self.is_last_step_ok != (not result.error):
            log.warning(
                "worker group %s is %s", self.group, "failing" if result.error else "healthy"
            )
        self.is_last_step_ok = not result.error
        log.debug(
            "step %d: %d tokens in %.2f ms", plan.step_id, result.num_tokens, result.step_s * 1e3
        )
        self._last_step_end = time.perf_counter()
        return outcome

    async def _publish(self, outcome: StepOutcome) -> None:
        """One PUBLISH per gateway, then the result, in one round trip."""
        started = time.perf_counter()
        async with self.redis.pipeline(transaction=False) as pipe:
            for reply_to, events in outcome.events.items():
                pipe.publish(reply_to, encode(ReplyBatch(events=events)))
            pipe.xadd(
                self.channels.results(self.group),
                stream_fields(outcome.result),
                maxlen=RESULTS_MAXLEN,
                approximate=True,
            )
            await pipe.execute()
        self.metrics.publish_duration.observe(time.perf_counter() - started)

    async def _beat(self) -> None:
        """Heartbeat, and the group's announcement again: a restarted Redis gets it back."""
        beat = Heartbeat(
            group=self.group,
            at=time.time(),
            last_step_id=self.last_step_id,
            num_requests=len(self.runner.requests),
            is_last_step_ok=self.is_last_step_ok,
        )
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.channels.worker(self.group), self._ready_bytes)
            pipe.sadd(self.channels.groups, self.group)
            pipe.set(self.channels.heartbeat(self.group), encode(beat), ex=HEARTBEAT_TTL_S)
            await pipe.execute()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            try:
                await self._beat()
            except REDIS_ERRORS as exc:
                log.warning("heartbeat failed: %s", exc)
