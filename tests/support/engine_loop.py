"""Scheduler and ModelRunner driven in one process, without Redis, for tests that check the
engine's numerics alone (the services are checked end to end elsewhere)."""

from __future__ import annotations

import itertools

from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.worker.kv_cache import PagedKVCache
from services.worker.loader import LoadedModel
from services.worker.runner import ModelRunner
from shared.messages import GenerateRequest, SamplingParams, StoppingParams

_ids = itertools.count()


def make_request(input_ids: list[int], max_new_tokens: int, **sampling) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"r{next(_ids)}",
        input_ids=input_ids,
        sampling=SamplingParams(**sampling),
        stopping=StoppingParams(max_new_tokens=max_new_tokens),
        reply_to="test",
        created_at=0.0,
        deadline=0.0,
    )


class EngineLoop:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int = 16,
        max_batch_prefill_tokens: int = 4096,
        max_batch_size: int = 256,
    ) -> None:
        cache = PagedKVCache(loaded.cache_shape, num_blocks, block_size, loaded.device)
        self.runner = ModelRunner(
            loaded.model, cache, loaded.eos_token_ids, loaded.max_model_len, loaded.device
        )
        config = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_batch_prefill_tokens=max_batch_prefill_tokens,
            max_batch_size=max_batch_size,
        )
        self.scheduler = Scheduler(config, clock=lambda: 0.0)
        self.tokens: dict[str, list[int]] = {}
        self.step_sizes: list[int] = []
        self.ended = []  # SchedRequests that ended

    def add(self, request: GenerateRequest) -> None:
        self.scheduler.add(request, b"0-0")
        self.tokens[request.request_id] = []

    def step(self) -> bool:
        plan = self.scheduler.schedule()
        self.ended.extend(self.scheduler.take_ended())
        if plan is None:
            return False
        self.step_sizes.append(len(plan.new_requests) + len(plan.running))
        outcome = self.runner.execute(plan)
        assert not outcome.result.error, outcome.result.error
        for events in outcome.events.values():
            for event in events:
                self.tokens[event.request_id].extend(event.token_ids)
        self.scheduler.update(outcome.result)
        self.ended.extend(self.scheduler.take_ended())
        return True

    def run(self) -> None:
        while self.step():
            pass
