"""A CPU worker suggests a step budget for its speed: STEP_TARGET_S of matmuls, as a power of
two within [MIN_TOKENS, MAX_TOKENS] (tests/scheduler/test_step_budget.py: the scheduler takes
it unless the flag sets one)."""

from __future__ import annotations

import torch

from services.worker import step_budget
from services.worker.step_budget import MAX_TOKENS, MIN_TOKENS, budget_for


def test_budget_is_the_power_of_two_below_the_target_time():
    per_token = 270_000_000  # SmolLM2-135M's linear FLOPs per token
    assert budget_for(150, per_token) == MIN_TOKENS  # float32 on 2 cores: 278 tokens in 0.5 s
    assert budget_for(1600, per_token) == 2048  # bfloat16 on AMX: 2963 tokens
    assert budget_for(3000, per_token) == 4096  # 5555 tokens: capped
    assert budget_for(1e6, per_token) == MAX_TOKENS
    assert budget_for(1600, 10 * per_token) == MIN_TOKENS  # a 10x larger model
    for gflops in (1, 50, 400, 900, 2000, 10_000):
        budget = budget_for(gflops, per_token)
        assert budget & (budget - 1) == 0 and MIN_TOKENS <= budget <= MAX_TOKENS
        if budget > MIN_TOKENS:  # never above the target time
            assert budget * per_token / (gflops * 1e9) <= step_budget.STEP_TARGET_S


def test_flops_per_token_reads_every_linear_layer():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    assert step_budget.linear_flops_per_token(model) == 2 * (8 * 16 + 16 * 4)


def test_a_cpu_worker_suggests_and_an_accelerator_does_not():
    model = torch.nn.Linear(64, 64)
    budget = step_budget.suggest(model, torch.device("cpu"), torch.float32)
    assert budget & (budget - 1) == 0 and MIN_TOKENS <= budget <= MAX_TOKENS
    assert budget == MAX_TOKENS  # 8 KFLOP per token: any CPU computes 4096 in 0.5 s
    assert step_budget.suggest(model, torch.device("cuda"), torch.float32) == 0
    assert step_budget.suggest(None, torch.device("cpu"), torch.float32) == 0  # simulated
    assert step_budget.matmul_gflops(torch.float32) > 0
