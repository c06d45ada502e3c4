"""The same scheduler and model runner as the services, wired by direct calls instead of
Redis: each StepPlan goes straight to ModelRunner.execute and each StepResult straight back
to Scheduler.update. This package composes two services, like the launcher does; the services
themselves never import each other."""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from services.scheduler.config import SchedulerConfig
from services.scheduler.request import SchedRequest
from services.scheduler.scheduler import Scheduler
from services.worker.fake import fake_model
from services.worker.loader import LoadedModel, load_model
from services.worker.runner import StepOutcome
from services.worker.runtime import build_runner, ready_message
from shared.messages import (
    AdapterRef,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    StoppingParams,
)


@dataclass
class Output:
    """One finished generation."""

    prompt: str | list[int]  # as given
    token_ids: list[int]  # generated tokens
    text: str  # generated_token ids decoded, special tokens skipped
    finish_reason: FinishReason | None
    num_prompt_tokens: int


@dataclass
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    step_sizes: list[int] = field(default_factory=list)  # requests per step
    num_draft_tokens: int = 0  # speculative proposals computed
    num_accepted_tokens: int = 0  # of those, confirmed
    # s between consecutive tokens of a request, as the caller sees them (the in-process
    # counterpart of the server's inter-token latency)
    token_gaps: list[float] = field(default_factory=list)


class Engine:
    """`Engine(model_id).generate(prompts, max_new_tokens=...)`: continuous batching, paged KV
    cache, chunked prefill and prefix caching, in this process."""

    def __init__(
        self,
        model_id: str | LoadedModel,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_batch_prefill_tokens: int | None = None,
        max_batch_size: int = 256,
        enable_prefix_caching: bool = True,
        steps_in_flight: int = 2,
        dtype: str = "auto",
        device: str | None = None,
        quantize: str | None = None,
        speculate: int = 0,
        cpu_kernels: bool = True,
        max_loras: int = 4,
        cuda_graphs: list[int] | None = None,
        compile: bool = True,
        fake_step_ms: float | None = None,
    ) -> None:
        """`fake_step_ms`: the simulated worker's forward pass (services/worker/fake.py: every
        step takes that long, no weights are loaded), to measure what surrounds the steps."""
        self.fake_step_ms = fake_step_ms
        if isinstance(model_id, LoadedModel):
            self.loaded = model_id
        elif fake_step_ms is not None:
            self.loaded = fake_model(model_id)
        else:
            self.loaded = load_model(
                model_id, dtype=dtype, device=device, quantize=quantize, cpu_kernels=cpu_kernels
            )
        self.runner = build_runner(
            self.loaded,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory,
            max_batch_size=max_batch_size,
            speculate=speculate,
            max_loras=max_loras,
            cuda_graphs=cuda_graphs,
            compile=compile,
            fake_step_ms=fake_step_ms,
        )
        # the scheduler service's policy (watermark included) for this runner, as announced
        ready = ready_message(
            self.runner, self.loaded, group="engine", model_id="", max_batch_size=max_batch_size
        )
        self.scheduler = Scheduler(
            SchedulerConfig.for_worker(
                ready, max_batch_prefill_tokens, max_batch_size, enable_prefix_caching
            ),
            clock=time.time,
        )
        self.stats = EngineStats()
        self.steps_in_flight = steps_in_flight
        self._in_flight: deque[StepOutcome] = deque()
        self._tokenizer: Any = None
        self._ids = itertools.count()
        self._outputs: dict[str, list[int]] = {}
        self._num_added = 0
        self._num_prompt_tokens: dict[str, int] = {}
        self._last_token_at: dict[str, float] = {}  # perf_counter s of each one's last token
        self._finish: dict[str, FinishReason | None] = {}
        self._errors: dict[str, str] = {}
        self.ended: list[SchedRequest] = []  # requests the scheduler ended, in order

    @property
    def tokenizer(self):
        """The model's tokenizers.Tokenizer (from tokenizer.json)."""
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.loaded.folder / "tokenizer.json"))
        return self._tokenizer

    def add(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        stop_token_ids: list[int] | None = None,
        generated_ids: list[int] | None = None,
        adapter: AdapterRef | None = None,
    ) -> str:
        """Queue one request; its id (its Output: `take(request_id)` once run).
        `generated_ids`: tokens it generated before (resumed, as after a failover); its Output
        holds the tokens generated after them."""
        request_id = f"e{next(self._ids)}"
        self.scheduler.add(
            GenerateRequest(
                request_id=request_id,
                input_ids=input_ids,
                sampling=sampling or SamplingParams(),
                stopping=StoppingParams(
                    max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids or []
                ),
                reply_to="",
                created_at=time.time(),
                deadline=0.0,
                generated_ids=generated_ids or [],
                adapter=adapter,
            ),
            b"0-0",
        )
        self._outputs[request_id] = []
        self._num_prompt_tokens[request_id] = len(input_ids)
        self._num_added += 1
        return request_id

    @property
    def num_unfinished(self) -> int:
        """Requests added that have not ended yet."""
        return self._num_added - len(self.ended)

    def step(self) -> bool:
        """Plan and run one step, and answer the oldest one once `steps_in_flight` are out
        (2: step N+1 is planned before the scheduler hears of step N, as the services do);
        False when nothing is left to do."""
        plan = None
        if len(self._in_flight) < self.steps_in_flight:
            plan = self.scheduler.schedule()
            self._take_ended()
        if plan is not None:
            self._in_flight.append(self.runner.execute(plan))
            self.stats.num_steps += 1
            self.stats.step_sizes.append(len(plan.new_requests) + len(plan.running))
        if not self._in_flight:
            return False
        if plan is None or len(self._in_flight) >= self.steps_in_flight:
            self._answer(self._in_flight.popleft())
        return True

    def _answer(self, outcome: StepOutcome) -> None:
        now = time.perf_counter()
        self.stats.num_draft_tokens += outcome.result.num_draft_tokens
        self.stats.num_accepted_tokens += outcome.result.num_accepted_tokens
        for events in outcome.events.values():
            for event in events:
                if event.token_ids:
                    last = self._last_token_at.get(event.request_id)
                    if last is not None:
                        self.stats.token_gaps.append(now - last)
                    self._last_token_at[event.request_id] = now
                if event.finish_reason is not None or event.error:
                    self._last_token_at.pop(event.request_id, None)
                self._outputs[event.request_id].extend(event.token_ids)
                self.stats.num_generated_tokens += len(event.token_ids)
                if event.finish_reason is not None:
                    self._finish[event.request_id] = event.finish_reason
                if event.error:
                    self._errors[event.request_id] = event.error
        self.scheduler.update(outcome.result)
        self._take_ended()

    def _take_ended(self) -> None:
        for ended in self.scheduler.take_ended():
            self.ended.append(ended)
            if ended.error:
                self._errors[ended.request_id] = ended.error

    def run(self) -> None:
        while self.step():
            pass

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
    ) -> list[Output]:
        """Generate for every prompt (text, or token ids), all batched together."""
        tokenized = [
            self.tokenizer.encode(p).ids if isinstance(p, str) else list(p) for p in prompts
        ]
        request_ids = [self.add(ids, max_new_tokens, sampling) for ids in tokenized]
        self.run()
        given: list[str | list[int]] = list(prompts)
        return [
            self.take(request_id, prompt)
            for prompt, request_id in zip(given, request_ids, strict=True)
        ]

    def take(self, request_id: str, prompt: str | list[int] | None = None) -> Output:
        """The finished output of an added request (once); raises if it failed."""
        if self._errors.get(request_id):
            raise RuntimeError(f"request {request_id} failed: {self._errors.pop(request_id)}")
        token_ids = self._outputs.pop(request_id)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""
        num_prompt = self._num_prompt_tokens.pop(request_id)
        finish = self._finish.pop(request_id, None)
        return Output(prompt if prompt is not None else [], token_ids, text, finish, num_prompt)
