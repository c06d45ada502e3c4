"""The scheduler's policy knobs, and the counters it keeps for operators."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shared.messages import WorkerReady
from shared.settings import step_tokens

log = logging.getLogger(__name__)

# a prompt may overrun the step budget by 1/PROMPT_TAIL_FRACTION of it to finish in this step:
# else its last few tokens wait a whole step (1024-token prompts with a 1024-token budget and
# 3 decodes beside them spilled 3 tokens each into the next prompt's step)
PROMPT_TAIL_FRACTION = 16


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int  # KV blocks of the worker group
    block_size: int  # tokens per block
    max_batch_prefill_tokens: int = 4096  # tokens computed per step (prefill and decode; a
    # prompt may finish up to a sixteenth past it)
    max_batch_size: int = 256  # requests per step
    watermark_blocks: int = 0  # blocks kept free when admitting, so decodes rarely preempt
    enable_prefix_caching: bool = True  # reuse cached blocks of equal prompt prefixes
    num_speculative_tokens: int = 0  # n-gram proposals the worker may add to a greedy decode
    max_loras: int = 0  # distinct LoRA adapters running at once (the worker's slots); 0: no cap

    def chunk(self, remaining: int, budget: int) -> int:
        """Tokens of a request to compute in a step with `budget` left: as many as fit, or all
        `remaining` where at most 1/PROMPT_TAIL_FRACTION of the budget would be left over."""
        if budget <= 0:
            return 0
        if remaining - budget <= self.max_batch_prefill_tokens // PROMPT_TAIL_FRACTION:
            return remaining
        return budget

    @classmethod
    def for_worker(
        cls,
        ready: WorkerReady,
        max_batch_prefill_tokens: int | None,
        max_batch_size: int,
        enable_prefix_caching: bool = True,
    ) -> SchedulerConfig:
        """The policy for a worker group as it announced itself (the scheduler service and
        the in-process engine both plan with this): its blocks, a watermark of 1% of them,
        prefix caching only where attention reads the paged cache; the step budget given, else
        the worker's suggestion, else the device's default."""
        return cls(
            num_blocks=ready.num_blocks,
            block_size=ready.block_size,
            max_batch_prefill_tokens=step_tokens(
                max_batch_prefill_tokens, ready.device, ready.step_tokens
            ),
            max_batch_size=min(max_batch_size, ready.max_batch_size),
            watermark_blocks=max(1, ready.num_blocks // 100),
            enable_prefix_caching=enable_prefix_caching and ready.runner == "paged",
            num_speculative_tokens=ready.num_speculative_tokens,
            max_loras=ready.max_loras,
        )


@dataclass
class StepCounters:
    num_steps: int = 0
    num_finished: int = 0
    max_step_batch_size: int = 0
    num_joined_running: int = 0
    num_prefill_chunks: int = 0
    num_prompt_tails: int = 0  # prompts finished past the step budget (by 1/16 of it at most)
    num_mixed_steps: int = 0
    num_preempted: int = 0
    num_admitted_tokens: int = 0  # known tokens of requests at admission
    num_cached_tokens: int = 0  # of those, found in the prefix cache

    def spend(self, budget: int, num_tokens: int) -> int:
        """The step budget left after a request's `num_tokens`, counting a prompt's overrun."""
        if num_tokens > budget:
            self.num_prompt_tails += 1
            log.debug("a prompt's last %d tokens overrun the step budget", num_tokens - budget)
        return budget - num_tokens
