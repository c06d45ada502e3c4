"""The scheduler's policy knobs, and the counters it keeps for operators."""

from __future__ import annotations

from dataclasses import dataclass

from shared.messages import WorkerReady
from shared.settings import step_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int  # KV blocks of the worker group
    block_size: int  # tokens per block
    max_batch_prefill_tokens: int = 4096  # tokens computed per step (prefill and decode)
    max_batch_size: int = 256  # requests per step
    watermark_blocks: int = 0  # blocks kept free when admitting, so decodes rarely preempt
    enable_prefix_caching: bool = True  # reuse cached blocks of equal prompt prefixes
    num_speculative_tokens: int = 0  # n-gram proposals the worker may add to a greedy decode
    max_loras: int = 0  # distinct LoRA adapters running at once (the worker's slots); 0: no cap

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
    num_mixed_steps: int = 0
    num_preempted: int = 0
    num_admitted_tokens: int = 0  # known tokens of requests at admission
    num_cached_tokens: int = 0  # of those, found in the prefix cache
