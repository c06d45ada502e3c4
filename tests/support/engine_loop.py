"""The in-process engine, driven request by request, for tests that check the engine's
numerics alone (the services are checked end to end elsewhere)."""

from __future__ import annotations

import itertools

from services.engine import Engine
from services.worker.loader import LoadedModel
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


class EngineLoop(Engine):
    """An Engine fed ready-made GenerateRequests; `tokens` maps request id -> generated ids."""

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int = 16,
        max_batch_prefill_tokens: int | None = None,
        max_batch_size: int = 256,
        steps_in_flight: int = 2,
        compile: bool = False,
    ) -> None:
        super().__init__(
            loaded,
            compile=compile,
            num_blocks=num_blocks,
            block_size=block_size,
            max_batch_prefill_tokens=max_batch_prefill_tokens,
            max_batch_size=max_batch_size,
            steps_in_flight=steps_in_flight,
        )
        self.tokens = self._outputs
        self.step_sizes = self.stats.step_sizes

    def add(self, request: GenerateRequest) -> None:  # type: ignore[override]
        self.scheduler.add(request, b"0-0")
        self.tokens[request.request_id] = []
