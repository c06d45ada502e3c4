"""The worker's Redis loop: announce capacity, execute step plans, stream tokens back.

The torch thread does the per-step work: it reads StepPlans from {textgen:group:<g>}:steps, runs
them on the ModelRunner, and writes one PUBLISH of a ReplyBatch per gateway and the XADD of the
StepResult to {textgen:group:<g>}:results in one packet (services/worker/step_link.py: the next plan
is already in the socket when a step ends, and no write waits for Redis's reply) before the
next step, or on a GPU while the next step's pass runs. The event loop announces the group
and beats; a long forward never delays a heartbeat.
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
import torch

from services.worker.fast_decoder import FAST_DECODER
from services.worker.loader import LoadedModel
from services.worker.lora import retain_registered
from services.worker.metrics import WorkerMetrics
from services.worker.runner import StepOutcome
from services.worker.runtime import build_runner, ready_message
from services.worker.step_link import (
    BLOCK_MS,
    STOPPING_BLOCK_MS,
    Command,
    StepLink,
    skip_ended_sessions,
    xadd,
)
from shared.adapters import AdapterRegistry, startup_refs
from shared.bus import FIELD, REDIS_ERRORS, REDIS_FAILURES, entry_message, stream_fields
from shared.channels import DEAD_LETTERS_MAXLEN, Channels
from shared.codec import decode, encode
from shared.master_watch import MasterWatch
from shared.messages import AdapterRef, Heartbeat, ReplyBatch, StepPlan, WorkerReady
from shared.settings import Settings, parse_cuda_graphs

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 1.0  # between Redis retries: a failover takes seconds, follow it soon
# a stopping worker that holds requests and got no plan for this long stops: their scheduler
# is gone, and waiting out --shutdown-grace would finish nothing
ORPHANED_AFTER_S = 3.0

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5
RESULTS_MAXLEN = 1000
# the backend's running counts that the metrics of the same names follow
STEP_COUNTS = ("graph_steps", "mixed_graph_steps", "compiled_steps", "tiled_chunks")
# how a step ran, by the count it added to (the DEBUG step line; none of them: eager modules)
RAN_AS = {
    "graph_steps": "decode graph",
    "mixed_graph_steps": "mixed graph",
    "compiled_steps": "compiled",
}


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
        # a new master named by the sentinels: the step link and the heartbeat leave the old one
        self.master = MasterWatch.for_settings(settings, [redis], self.metrics.master_switches.inc)
        self.runner = build_runner(
            loaded,
            block_size=settings.block_size,
            kv_cache_memory=settings.kv_cache_memory,
            max_batch_size=settings.max_batch_size,
            max_batch_total_tokens=settings.max_batch_total_tokens,
            speculate=settings.speculate,
            fake_step_ms=settings.fake_step_ms,
            # the ranks of a group sample alike only if they mask alike: not yet with grammars
            grammar_compile_timeout=(
                settings.grammar_compile_timeout if settings.num_shard == 1 else None
            ),
            metrics=self.metrics,
            max_loras=settings.max_loras,
            cuda_graphs=parse_cuda_graphs(settings.cuda_graphs),
            compile=not settings.disable_compile,
        )
        self.metrics.kv_blocks.set(self.runner.kv_cache.num_blocks)
        # --lora-adapters, checked now (a bad one stops the worker), registered in announce()
        self.startup_adapters = startup_refs(settings)
        kernels = self.runner.kernels if self.runner.attention == FAST_DECODER else None
        instruction_set = kernels.level if kernels is not None else ""
        bf16_matmul = kernels.matmul.kind(torch.bfloat16) if kernels is not None else ""
        bf16_attention = kernels.bf16_attention if kernels is not None else ""
        fused = loaded.decoder is not None or loaded.projections_fused  # the decoder fuses too
        self.metrics.attention.labels(
            self.runner.attention,
            instruction_set,
            bf16_matmul,
            bf16_attention,
            "fused" if fused else "apart",
        ).set(1)
        self.metrics.torch_threads.set(torch.get_num_threads())
        self.last_step_id = 0
        self.started_at = time.time()  # identifies this worker's lifetime to its scheduler
        self._ready_bytes = encode(self.ready_message())
        self.is_last_step_ok = True  # a failed step makes the group unhealthy until one succeeds
        self.stop_at: float | None = None  # unix s; set by request_stop()
        # every forward on the thread that loaded the model: see services/worker/main.py
        self._forward_thread = torch_thread or ThreadPoolExecutor(1, thread_name_prefix="torch")
        self._last_step_end: float | None = None  # perf_counter, on the torch thread
        # the backend's counts (STEP_COUNTS) already added to the metrics
        self._counted = dict.fromkeys(STEP_COUNTS, 0)
        self._is_cancelled = False  # the event loop gave up on the torch thread's loop

    def ready_message(self) -> WorkerReady:
        return ready_message(
            self.runner,
            self.loaded,
            group=self.group,
            model_id=self.settings.model_id,
            max_batch_size=self.settings.max_batch_size,
            world_size=self.settings.num_shard,
            started_at=self.started_at,
        )

    async def announce(self) -> None:
        """Drop stale plans, then publish capacity: from here on the scheduler may plan."""
        channels = self.channels
        await self.redis.delete(channels.steps(self.group))
        if self.startup_adapters:
            await AdapterRegistry(self.redis, channels).register_startup(self.startup_adapters)
        await self._beat()
        log.info(
            "worker group %s ready: %d blocks of %d tokens, %d torch threads",
            self.group,
            self.runner.kv_cache.num_blocks,
            self.runner.kv_cache.block_size,
            torch.get_num_threads(),
        )

    async def run(self) -> None:
        await self.announce()
        self.master.start()
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        try:
            await self._step_loop()
        finally:
            heartbeat.cancel()
            await self.master.stop()

    def request_stop(self) -> None:
        """SIGTERM: keep executing the scheduler's steps until no request is held (the
        scheduler finishes or hands back its requests), for at most the grace period."""
        if self.stop_at is None:
            self.stop_at = time.time() + self.settings.shutdown_grace
            log.info("stopping once idle (at most %.0f s)", self.settings.shutdown_grace)

    async def _step_loop(self) -> None:
        """Run `_drive` on the torch thread until it ends; cancelled, the thread ends after the
        step it is on."""
        drive = asyncio.get_running_loop().run_in_executor(self._forward_thread, self._drive)
        try:
            await asyncio.shield(drive)
        finally:
            self._is_cancelled = True

    def _drive(self) -> None:
        """The torch thread's loop: the next plan, its step, the step's output sent; again until
        stopped. Its Redis work is done here and waits for nothing: the next plan is already in
        the socket (the scheduler sent N+1 before it hears of N), the output is written without
        waiting for Redis's reply (services/worker/step_link.py). Step N's output goes between
        N and N+1, or while N+1's pass runs where the backend queues it on its device. No other
        thread takes the GIL meanwhile. A Redis outage pauses reading and sending (retried
        with backoff), never ends the loop, never runs a plan twice."""
        link = StepLink(
            self.settings.redis_url,
            self.channels.steps(self.group),
            on_error_reply=self.metrics.redis_error_replies.inc,
            sentinels=self.settings.redis_sentinels,
            sentinel_master=self.settings.redis_sentinel_master,
            cluster=self.settings.redis_cluster,
            master=self.master,
        )
        plans: deque[StepPlan] = deque()
        unsent: list[StepOutcome] = []  # the step before's output, while the next pass runs

        def send_unsent(overlapped: bool = False) -> None:
            if unsent:
                self._send_until_sent(link, unsent.pop())
                if overlapped:
                    self.metrics.overlapped_sends.inc()

        try:
            while True:
                is_at_hand = bool(plans) or link.has_arrived()
                if not is_at_hand:  # nothing to overlap: the scheduler may wait for it
                    send_unsent()
                waited_from = time.perf_counter()
                if not self._next_plans(link, plans):
                    send_unsent()
                    return
                if not is_at_hand and self.runner.requests:
                    self.metrics.plan_late.observe(time.perf_counter() - waited_from)
                plan = plans.popleft()
                outcome = self._execute(plan, is_at_hand, lambda: send_unsent(overlapped=True))
                send_unsent()  # no pass was queued (none to run, or it failed)
                self.last_step_id = plan.step_id
                unsent.append(outcome)
                if not self.runner.backend.launches_async:
                    send_unsent()
        finally:
            link.close()

    def _next_plans(self, link: StepLink, plans: deque[StepPlan]) -> bool:
        """Read until `plans` holds one; False once stopping is due (stopping, and no request
        held, or no plan for ORPHANED_AFTER_S: no scheduler drives the ones held; or the grace
        period is over; or cancelled)."""
        backoff = 0.25
        silent_since = time.monotonic()
        while not self._is_cancelled and not self._is_overdue():
            if plans:
                return True
            is_stopping = self.stop_at is not None
            try:
                entries = link.read(STOPPING_BLOCK_MS if is_stopping else BLOCK_MS)
            except REDIS_ERRORS as exc:
                if is_stopping and not self.runner.requests:  # nothing to finish, nor to wait for
                    break
                log.warning("Redis unreachable (%s); retrying in %.2f s", exc, backoff)
                self.master.pause_blocking(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                silent_since = time.monotonic()  # an outage is no scheduler's silence
                continue
            backoff = 0.25
            if not entries and is_stopping and self._is_orphaned(silent_since):
                break
            for entry_id, fields in entries:
                try:
                    plans.append(entry_message(fields, StepPlan))
                except Exception as exc:  # a poisoned entry must not stop the worker
                    self._dead_letter(link, entry_id, fields, exc)
            if num_skipped := skip_ended_sessions(plans):
                log.info("skipped %d plans of an ended scheduler session", num_skipped)
                self.metrics.skipped_plans.inc(num_skipped)
            if not entries and is_stopping and not self.runner.requests:
                break
            if not entries:  # idle: the unloaded adapters go now, not at the next step
                retain_registered(self.runner.lora, self.runner.requests)
        log.info("stopped with %d requests held", len(self.runner.requests))
        return False

    def _is_orphaned(self, silent_since: float) -> bool:
        """Requests are held and no plan came for ORPHANED_AFTER_S: their scheduler is gone
        (one that drives requests sends a plan every step)."""
        if not self.runner.requests or time.monotonic() - silent_since < ORPHANED_AFTER_S:
            return False
        log.warning(
            "no plan for %.0f s while stopping: no scheduler drives the %d requests held "
            "(another takes them from the stream)",
            ORPHANED_AFTER_S,
            len(self.runner.requests),
        )
        return True

    def _is_overdue(self) -> bool:
        """Stopping, and the grace period is over: no more plans are executed."""
        return self.stop_at is not None and time.time() >= self.stop_at

    def _send_until_sent(self, link: StepLink, outcome: StepOutcome) -> None:
        """One PUBLISH per gateway, then the result, in one write; retried while Redis is
        unreachable (dropped only when cancelled meanwhile)."""
        commands: list[Command] = [
            ("PUBLISH", reply_to, encode(ReplyBatch(events=events)))
            for reply_to, events in outcome.events.items()
        ]
        results = self.channels.results(self.group)
        commands.append(xadd(results, stream_fields(outcome.result), RESULTS_MAXLEN))
        backoff = 0.25
        while True:
            started = time.perf_counter()
            try:
                link.send(commands)
            except REDIS_ERRORS as exc:
                if self._is_cancelled:
                    log.warning("step %d not published: %s", outcome.result.step_id, exc)
                    return
                log.warning("could not publish a step (%s); retrying in %.2f s", exc, backoff)
                self.master.pause_blocking(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            self.metrics.publish_duration.observe(time.perf_counter() - started)
            return

    def _dead_letter(self, link: StepLink, entry_id: bytes, fields: dict, exc: Exception) -> None:
        steps = self.channels.steps(self.group)
        reason = f"malformed StepPlan: {type(exc).__name__}: {exc}"
        log.error("dead-lettering entry %s of %s: %s", entry_id, steps, reason)
        letter = {
            b"source": steps.encode(),
            b"entry_id": entry_id,
            b"reason": reason.encode(),
            FIELD: fields.get(FIELD, b""),
        }
        with contextlib.suppress(*REDIS_ERRORS):  # lost with Redis: the error log stays
            link.send([xadd(self.channels.dead_letters, letter, DEAD_LETTERS_MAXLEN)])

    def _execute(
        self, plan: StepPlan, is_at_hand: bool, on_queued: Callable[[], None]
    ) -> StepOutcome:
        """Run `plan`; `is_at_hand`: it had arrived before the step before it ended;
        `on_queued`: for a backend that launches asynchronously, run once its pass is queued."""
        started = time.perf_counter()
        if is_at_hand and self._last_step_end is not None:
            self.metrics.step_gap.observe(started - self._last_step_end)
        if self.on_plan is not None:
            self.on_plan(plan)
        backend = self.runner.backend
        backend.on_queued = on_queued
        try:
            outcome = self.runner.execute(plan)  # per-request spans: see ModelRunner
        finally:
            backend.on_queued = None
        result = outcome.result
        result.session = plan.session
        self.metrics.observe_step(result, len(self.runner.requests))
        ran_as = "eager"
        for name in STEP_COUNTS:
            count = getattr(backend, name)
            if count > self._counted[name]:
                ran_as = RAN_AS.get(name, ran_as)
            getattr(self.metrics, name).inc(count - self._counted[name])
            self._counted[name] = count
        if result.error:
            self.metrics.step_failures.inc()
        if self.is_last_step_ok != (not result.error):
            log.warning(
                "worker group %s is %s", self.group, "failing" if result.error else "healthy"
            )
        self.is_last_step_ok = not result.error
        log.debug(
            "step %d: %d tokens of %d requests in %.2f ms (forward %.2f, sampling %.2f), %.2f ms "
            "after the step before, %s",
            plan.step_id,
            result.num_tokens,
            len(plan.new_requests) + len(plan.running),
            result.step_s * 1e3,
            result.forward_s * 1e3,
            result.sample_s * 1e3,
            (started - self._last_step_end) * 1e3 if self._last_step_end else 0.0,
            ran_as,
        )
        self._last_step_end = time.perf_counter()
        return outcome

    async def _beat(self) -> None:
        """Heartbeat, and the group's announcement again: a restarted Redis gets it back."""
        beat = Heartbeat(
            group=self.group,
            at=time.time(),
            last_step_id=self.last_step_id,
            num_requests=len(self.runner.requests),
            is_last_step_ok=self.is_last_step_ok,
            adapters=list(self.runner.lora.held) if self.runner.lora is not None else [],
        )
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.channels.worker(self.group), self._ready_bytes)
            pipe.sadd(self.channels.groups, self.group)
            pipe.set(self.channels.heartbeat(self.group), encode(beat), ex=HEARTBEAT_TTL_S)
            if self.runner.lora is not None:
                pipe.hgetall(self.channels.adapters)
            replies = await pipe.execute()
        if self.runner.lora is not None:  # adapters unregistered since are dropped when unused
            registered = [decode(data, AdapterRef) for data in replies[-1].values()]
            self.runner.lora.registered = {ref.id for ref in registered}

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            try:
                await self._beat()
            except REDIS_FAILURES as exc:  # an outage, or a refusal (a primary just demoted)
                self.metrics.heartbeat_failures.inc()
                log.warning("heartbeat failed: %s", exc)
            except Exception:  # a beat that stopped for good would drop the group: go on
                self.metrics.heartbeat_failures.inc()
                log.exception("heartbeat failed")
