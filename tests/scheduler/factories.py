"""Build schedulers and requests from a few knobs."""

from __future__ import annotations

import itertools

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.messages import (
    AdapterRef,
    FinishReason,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
    StepPlan,
    StepResult,
    StoppingParams,
)

_ids = itertools.count()


def request(
    num_prompt_tokens: int,
    max_new_tokens: int = 8,
    priority: int = 0,
    deadline: float = 0.0,
    prefix: list[int] | None = None,
    adapter: str = "",
    **sampling,
) -> GenerateRequest:
    """A request whose prompt is `prefix` then tokens no other request has; `adapter`: the id
    of a LoRA adapter it names."""
    number = next(_ids)
    prefix = prefix or []
    unique = [1000 * (number + 1) + i for i in range(num_prompt_tokens - len(prefix))]
    return GenerateRequest(
        request_id=f"q{number}",
        input_ids=prefix + unique,
        sampling=SamplingParams(**sampling),
        stopping=StoppingParams(max_new_tokens=max_new_tokens),
        reply_to="reply",
        created_at=0.0,
        deadline=deadline,
        priority=priority,
        adapter=AdapterRef(name=adapter, path="/", id=adapter) if adapter else None,
    )


def scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    prefill: int = 32,
    max_batch_size: int = 16,
    clock=lambda: 100.0,
    prefix_caching: bool = True,
    max_loras: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_batch_prefill_tokens=prefill,
            max_batch_size=max_batch_size,
            enable_prefix_caching=prefix_caching,
            max_loras=max_loras,
        ),
        clock=clock,
    )


def scheduled(plan: StepPlan) -> dict[str, int]:
    """request_id -> tokens scheduled in the plan."""
    out = {n.request_id: n.num_scheduled_tokens for n in plan.new_requests}
    out.update({r.request_id: r.num_scheduled_tokens for r in plan.running})
    return out


def answer(s: Scheduler, plan: StepPlan, finish: set[str] = frozenset()) -> StepResult:
    """A worker's result for `plan`: one token for each request that reached its last token."""
    outputs = []
    for request_id in scheduled(plan):
        r = s.requests[request_id]
        if r.num_computed_tokens == len(r.token_ids):
            reason = FinishReason.LENGTH if request_id in finish else None
            outputs.append(
                RequestOutput(request_id=request_id, token_ids=[7], finish_reason=reason)
            )
        else:
            outputs.append(RequestOutput(request_id=request_id))
    result = StepResult(step_id=plan.step_id, outputs=outputs)
    s.update(result)
    return result
