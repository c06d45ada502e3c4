"""The step budget's default follows the device: TGI's 4096 tokens on accelerators, on a CPU
the worker's suggestion for its speed, else 512 (a 4096-token CPU step can take seconds and
every prompt in it waits for its end); a given --max-batch-prefill-tokens always wins."""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from shared.messages import WorkerReady
from shared.settings import step_tokens


def ready(device: str, suggested: int = 0) -> WorkerReady:
    return WorkerReady(
        group="g",
        model_id="m",
        num_blocks=100,
        block_size=16,
        max_batch_size=8,
        max_model_len=512,
        device=device,
        step_tokens=suggested,
    )


def test_default_step_budget_per_device():
    assert step_tokens(None, "cpu") == 512
    assert step_tokens(None, "cuda:0") == step_tokens(None, "cuda") == 4096
    assert step_tokens(2048, "cpu") == 2048
    assert SchedulerConfig.for_worker(ready("cpu"), None, 8).max_batch_prefill_tokens == 512
    assert SchedulerConfig.for_worker(ready("cuda:1"), None, 8).max_batch_prefill_tokens == 4096
    assert SchedulerConfig.for_worker(ready("cpu"), 64, 8).max_batch_prefill_tokens == 64


def test_the_scheduler_takes_the_workers_suggestion_unless_the_flag_sets_one():
    assert SchedulerConfig.for_worker(ready("cpu", 2048), None, 8).max_batch_prefill_tokens == 2048
    assert SchedulerConfig.for_worker(ready("cpu", 2048), 64, 8).max_batch_prefill_tokens == 64
    assert step_tokens(None, "cpu", 1024) == 1024
    assert step_tokens(None, "cpu") == 512
