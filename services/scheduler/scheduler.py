"""Continuous batching: decisions only, no I/O.

`service.py` feeds requests in (`add`, `abort`), asks for a plan (`schedule`), and reports the
worker's answer (`update`). One rule drives every step, as in vLLM: each running request catches
its computed tokens up to its known tokens, under a per-step token budget
(`max_batch_prefill_tokens`). A prompt longer than the budget is therefore prefilled in chunks
while the other requests keep decoding in the same forward pass; a preempted request is
recomputed the same way. A prompt whose rest past the budget is at most a sixteenth of it
finishes in the step instead (config.py: PROMPT_TAIL_FRACTION).

Admission: waiting requests in (priority, arrival) order, head-of-line: the first one that does not
fit stops admission; one whose LoRA adapter would make more distinct adapters run than the
worker holds (`max_loras`) is passed over until a slot frees, as in vLLM. Blocks are allocated
as tokens are scheduled; when they run out, the newest running request is preempted (its blocks
freed, its tokens kept for recompute).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable

from services.scheduler.attempts import LaterAttempts
from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig, StepCounters
from services.scheduler.prefix_cache import cached_prefix, register_planned_blocks
from services.scheduler.request import RequestStatus, SchedRequest
from shared.messages import (
    GenerateRequest,
    NewRequest,
    RunningRequest,
    SchedulerStats,
    StepPlan,
    StepResult,
)

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.waiting: list[SchedRequest] = []  # sorted by SchedRequest.sort_key
        self.running: list[SchedRequest] = []  # admission order (newest last)
        self.requests: dict[str, SchedRequest] = {}  # every unfinished request by id
        self.counters = StepCounters()
        self._released_ids: list[str] = []  # to tell the worker in the next plan
        self._ended: list[SchedRequest] = []  # ended requests not yet taken by the service
        self._next_step_id = 0
        self._num_arrivals = 0
        self._is_first_plan = True
        # plans awaiting their result: (request_id, samples, tokens computed through the step)
        self._step_requests: dict[int, list[tuple[str, bool, int]]] = {}
        # plans awaiting their result: the blocks each registered in the prefix cache
        self._step_blocks: dict[int, list[int]] = {}
        self._later_attempts = LaterAttempts()  # re-submissions waiting for a step in flight

    # --- inputs --------------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add(self, message: GenerateRequest, entry_id: bytes, stream: str = "") -> bool:
        """A request pulled from the stream; False when it is a copy of no later an attempt
        than the one held or waiting: the caller acknowledges its entry (a redelivery of the
        entry held or waiting is no copy). A later attempt replaces the held one
        (services/scheduler/attempts.py)."""
        held = self.requests.get(message.request_id)
        if self._later_attempts.refuses(message, held.message.attempt if held else None):
            waiting = self._later_attempts.entry_of(message.request_id)
            return entry_id in (held.entry_id if held else None, waiting)
        if held is None and message.request_id not in self._later_attempts:
            self._add_new(message, entry_id, stream)
            return True
        if held is not None:
            new, old = message.attempt, held.message.attempt
            log.info("request %s: attempt %d replaces attempt %d", message.request_id, new, old)
            self._end(held, RequestStatus.ABORTED)
        self._later_attempts.wait((message, entry_id, stream))
        self._add_later_attempts()
        return True

    def _add_later_attempts(self) -> None:
        in_flight = {rid for step in self._step_requests.values() for rid, _, _ in step}
        for pulled in self._later_attempts.ready(in_flight):
            self._add_new(*pulled)

    def _add_new(self, message: GenerateRequest, entry_id: bytes, stream: str) -> None:
        request = SchedRequest.from_message(message, entry_id, self._num_arrivals, stream)
        request.pulled_at = self.clock()
        self._num_arrivals += 1
        self.requests[request.request_id] = request
        self._enqueue(request)

    def abort(self, request_id: str, below_attempt: int = 0) -> bool:
        """Drop a request the gateway no longer wants (only if its attempt is below
        `below_attempt`, unless that is 0); False if there is none such here."""
        waiting = self._later_attempts.take_below(request_id, below_attempt)
        if waiting is not None:
            self._add_new(*waiting)  # ended below, so its entry is acknowledged
        request = self.requests.get(request_id)
        if request is None or (below_attempt and request.message.attempt >= below_attempt):
            return False
        self._end(request, RequestStatus.ABORTED)
        return True

    def expire(self) -> None:
        """End requests whose deadline passed: nobody waits for them any more."""
        now = self.clock()
        for request in list(self.requests.values()):
            if request.message.deadline and request.message.deadline < now:
                self._end(request, RequestStatus.EXPIRED)

    def update(self, result: StepResult) -> None:
        """Apply the worker's answer to a plan."""
        self._apply(result)
        if self._later_attempts:
            self._add_later_attempts()

    def _apply(self, result: StepResult) -> None:
        scheduled = self._step_requests.pop(result.step_id, [])
        registered = self._step_blocks.pop(result.step_id, [])
        for request_id, samples, _ in scheduled:
            request = self.requests.get(request_id)
            if request is not None and samples:
                request.num_inflight_samples -= 1
        if result.error:
            # the worker already told the gateways; end every request of the step
            log.error("step %d failed on the worker: %s", result.step_id, result.error)
            for request_id, _, _ in scheduled:
                request = self.requests.get(request_id)
                if request is not None:
                    self._end(request, RequestStatus.FAILED, is_on_worker_done=True)
            self._forget_blocks(registered, result.error)
            return
        for output in result.outputs:
            request = self.requests.get(output.request_id)
            if request is None:
                continue  # aborted (or finished in an earlier step) while the step ran
            if output.error:  # the worker failed it alone and told its gateway
                if output.refused:  # blocks it registered in that step hold nothing
                    held = set(request.block_ids)
                    self._forget_blocks([b for b in registered if b in held], output.error)
                self._end(request, RequestStatus.FAILED, is_on_worker_done=True)
                continue
            if output.awaits_grammar and request.status == RequestStatus.RUNNING:
                # its grammar is compiling: the worker computes its last token again later
                request.num_computed_tokens -= 1
                continue
            request.token_ids.extend(output.token_ids)
            if request.status == RequestStatus.RUNNING and len(output.token_ids) > 1:
                # speculation: every token but the last was computed in that forward pass
                request.num_computed_tokens += len(output.token_ids) - 1
            if output.finish_reason is not None:
                self._end(request, RequestStatus.FINISHED, is_on_worker_done=True)

    def withdraw(self, only_waiting: bool) -> None:
        """End waiting (or all) requests as HANDED_BACK: the service requeues them; later
        attempts waiting for a step in flight too (never sent to the worker)."""
        for pulled in self._later_attempts.ready():
            self._add_new(*pulled)
        for request in list(self.requests.values()):
            if not only_waiting or request.status == RequestStatus.WAITING:
                self._end(request, RequestStatus.HANDED_BACK)

    def held_entries(self) -> list[tuple[str, bytes]]:
        """(stream, entry id) of every request held, later attempts waiting included."""
        held = [(r.stream, r.entry_id) for r in self.requests.values()]
        return held + self._later_attempts.entries()

    def take_ended(self) -> list[SchedRequest]:
        """Requests that ended since the last call (to acknowledge on the stream)."""
        ended, self._ended = self._ended, []
        return ended

    # --- the plan ------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The next step, or None when there is nothing to compute."""
        budget = self.config.max_batch_prefill_tokens
        scheduled: list[tuple[SchedRequest, int, list[int]]] = []
        has_running = bool(self.running)
        budget = self._schedule_running(scheduled, budget)
        self._admit_waiting(scheduled, budget, has_running)
        if not scheduled and not self._released_ids:
            return None
        return self._make_plan(scheduled)

    def _schedule_running(
        self, scheduled: list[tuple[SchedRequest, int, list[int]]], budget: int
    ) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_tokens = self.config.chunk(request.num_uncomputed_tokens, budget)
            if num_tokens <= 0:
                index += 1
                continue
            lookahead = request.lookahead(num_tokens, self.config.num_speculative_tokens)
            new_block_ids = self._grow(request, num_tokens + lookahead)
            if new_block_ids is None:  # no blocks left: preempt the newest request
                victim = self.running[-1]
                self._preempt(victim, scheduled)
                if victim is request:
                    break
                continue
            scheduled.append((request, num_tokens, new_block_ids))
            budget = self.counters.spend(budget, num_tokens)
            index += 1
        return budget

    def _admit_waiting(
        self, scheduled: list[tuple[SchedRequest, int, list[int]]], budget: int, has_running: bool
    ) -> None:
        adapters = {r.adapter_id for r in self.running if r.adapter_id}
        index = 0  # waiting requests before it wait for an adapter slot
        while index < len(self.waiting) and budget > 0:
            if len(self.running) >= self.config.max_batch_size:
                break
            request = self.waiting[index]
            if request.num_inflight_samples:
                break  # preempted with a step in flight: re-admit once its token is known
            if self.blocks.num_blocks_for(len(request.token_ids) + 1) > self.blocks.num_blocks:
                capacity = self.blocks.num_blocks * self.blocks.block_size
                request.error = (
                    f"the request needs {len(request.token_ids) + 1} tokens of KV cache, more "
                    f"than the worker group holds ({capacity})"
                )
                self._end(request, RequestStatus.FAILED)
                continue
            adapter = request.adapter_id
            cap = self.config.max_loras
            if adapter and cap and adapter not in adapters and len(adapters) >= cap:
                index += 1  # every adapter slot is taken: later requests may fit (vLLM's rule)
                continue
            cached = cached_prefix(self.blocks, request, self.config.enable_prefix_caching)
            num_cached = len(cached) * self.blocks.block_size
            num_tokens = self.config.chunk(len(request.token_ids) - num_cached, budget)
            num_blocks = self.blocks.num_missing_blocks(num_cached + num_tokens, len(cached))
            if not self.blocks.can_allocate(num_blocks, reserve=self.config.watermark_blocks):
                self.blocks.free(cached)
                break  # head-of-line: keep arrival order
            self.waiting.pop(index)
            if adapter:
                adapters.add(adapter)
            request.block_ids = cached + self.blocks.allocate(num_blocks)
            request.num_hashed_blocks = len(cached)  # registered already
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            self.counters.num_admitted_tokens += len(request.token_ids)
            self.counters.num_cached_tokens += num_cached
            request.status = RequestStatus.RUNNING
            if not request.scheduled_at:
                request.scheduled_at = self.clock()
            self.running.append(request)
            if has_running:
                self.counters.num_joined_running += 1
            scheduled.append((request, num_tokens, request.block_ids))
            budget = self.counters.spend(budget, num_tokens)

    def _forget_blocks(self, block_ids: list[int], error: str) -> None:
        """A failed step's blocks hold nothing: drop them from the prefix cache, and fail the
        requests that took them from it since."""
        if not block_ids:
            return
        self.blocks.forget(block_ids)
        lost = set(block_ids)
        for request in list(self.running):
            if lost.intersection(
                request.block_ids[: request.num_cached_tokens // self.blocks.block_size]
            ):
                request.error = f"a step that computed its cached prompt prefix failed: {error}"
                self._end(request, RequestStatus.FAILED)

    def _grow(self, request: SchedRequest, num_tokens: int) -> list[int] | None:
        """Blocks to add so the request can compute num_tokens more; None if not enough."""
        target = request.num_computed_tokens + num_tokens
        missing = self.blocks.num_missing_blocks(target, len(request.block_ids))
        if not self.blocks.can_allocate(missing):
            return None
        new_block_ids = self.blocks.allocate(missing)
        request.block_ids.extend(new_block_ids)
        return new_block_ids

    def _preempt(
        self, request: SchedRequest, scheduled: list[tuple[SchedRequest, int, list[int]]]
    ) -> None:
        """Free a running request's blocks and put it back at the head of the queue."""
        assert all(other is not request for other, _, _ in scheduled)
        self.running.remove(request)
        self.blocks.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = request.num_hashed_blocks = 0
        request.status = RequestStatus.WAITING
        if request.is_on_worker:
            self._released_ids.append(request.request_id)
            request.is_on_worker = False
        self.counters.num_preempted += 1
        log.info(
            "preempted %s (%d tokens to recompute)", request.request_id, len(request.token_ids)
        )
        self._enqueue(request)

    def _make_plan(self, scheduled: list[tuple[SchedRequest, int, list[int]]]) -> StepPlan:
        new_requests: list[NewRequest] = []
        running: list[RunningRequest] = []
        num_decodes = num_prefill_tokens = 0
        step_requests = []
        registered: list[int] = []
        for request, num_tokens, new_block_ids in scheduled:
            num_known = request.num_known_tokens
            samples = request.num_computed_tokens + num_tokens == num_known
            if request.num_computed_tokens < num_known - 1:  # a prompt (or recompute) chunk
                num_prefill_tokens += num_tokens
                if not samples:
                    self.counters.num_prefill_chunks += 1
            else:
                num_decodes += 1
            if request.is_on_worker:
                running.append(
                    RunningRequest(
                        request_id=request.request_id,
                        new_block_ids=new_block_ids,
                        num_scheduled_tokens=num_tokens,
                    )
                )
            else:
                new_requests.append(request.as_new(num_tokens))
                request.is_on_worker = True
            request.num_computed_tokens += num_tokens
            request.num_inflight_samples += samples
            step_requests.append((request.request_id, samples, request.num_computed_tokens))
            registered.extend(
                register_planned_blocks(self.blocks, request, self.config.enable_prefix_caching)
            )
        if num_decodes and num_prefill_tokens:
            self.counters.num_mixed_steps += 1
        self.counters.num_steps += 1
        self.counters.max_step_batch_size = max(self.counters.max_step_batch_size, len(scheduled))
        plan = StepPlan(
            step_id=self._next_step_id,
            reset=self._is_first_plan,
            new_requests=new_requests,
            running=running,
            released_ids=self._released_ids,
            sent_at=self.clock(),
        )
        self._released_ids = []
        self._step_requests[plan.step_id] = step_requests
        if registered:
            self._step_blocks[plan.step_id] = registered
        self._next_step_id += 1
        self._is_first_plan = False
        return plan

    # --- bookkeeping ---------------------------------------------------------------------

    def _enqueue(self, request: SchedRequest) -> None:
        keys = [r.sort_key for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, request.sort_key), request)

    def _end(
        self, request: SchedRequest, status: RequestStatus, is_on_worker_done: bool = False
    ) -> None:
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.blocks.free(request.block_ids)
            request.block_ids = []
        if request.is_on_worker and not is_on_worker_done:
            self._released_ids.append(request.request_id)
        request.is_on_worker = False
        request.status = status
        del self.requests[request.request_id]
        self._ended.append(request)
        if status == RequestStatus.FINISHED:
            self.counters.num_finished += 1

    def stats(self, group: str, draining: bool = False) -> SchedulerStats:
        return SchedulerStats(
            group=group,
            at=self.clock(),
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self._later_attempts),
            num_blocks=self.blocks.num_blocks,
            num_free_blocks=self.blocks.num_free_blocks,
            num_cached_blocks=self.blocks.num_cached_blocks,
            draining=draining,
            **dataclasses.asdict(self.counters),  # its counters, named alike
        )
