"""The step budget a CPU worker suggests to its scheduler: about as many tokens as its matmuls
compute in STEP_TARGET_S.

A CPU's speed per token spans two orders of magnitude across dtypes and models: SmolLM2-135M
prefills ~600 tokens/s in float32 on 2 cores but ~6,000 in bfloat16 on AMX. One fixed budget
is wrong for one of them: a prompt in a step waits for the whole step, so 4096 float32 tokens
hold every first token for seconds, while 512 bfloat16 tokens cut a long prompt into chunks
that each pay a step's fixed costs and wait behind decodes (1024-token prompts at 4 streams:
TTFT p50 1066 ms at 512, 752 ms at 2048). The worker therefore times one matmul of a fixed
shape in its dtype at start-up (a few ms), divides by the model's linear FLOPs per token, and
suggests the power of two below STEP_TARGET_S worth of tokens, within [MIN_TOKENS,
MAX_TOKENS]. Accelerators suggest nothing (0): the scheduler keeps their default.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

log = logging.getLogger(__name__)

STEP_TARGET_S = 0.5  # matmul time of a full step the budget aims at
MIN_TOKENS = 512  # the CPU default before this rule; a step must hold a full decode batch
MAX_TOKENS = 4096  # TGI's default on accelerators
PROBE_SHAPE = (256, 1024, 2048)  # rows, inner, outer of the timed matmul
PROBE_REPEATS = 10  # a few ms in all: the best of many hides a noisy neighbour


@functools.cache
def matmul_gflops(dtype: torch.dtype) -> float:
    """GFLOP/s of a PROBE_SHAPE matmul in `dtype` on this CPU (best of PROBE_REPEATS)."""
    rows, inner, outer = PROBE_SHAPE
    x = torch.randn(rows, inner).to(dtype)
    weight = torch.randn(outer, inner).to(dtype)
    for _ in range(2):  # oneDNN picks and builds its kernel; the core wakes up
        torch.nn.functional.linear(x, weight)
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        started = time.perf_counter()
        torch.nn.functional.linear(x, weight)
        best = min(best, time.perf_counter() - started)
    return 2 * rows * inner * outer / best / 1e9


def linear_flops_per_token(model: torch.nn.Module) -> int:
    """2 x the weights of every linear layer (the output head included): a token's matmul
    FLOPs. Read from the layers' shapes, which stay when the fast decoder takes their
    weights."""
    return 2 * sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)
    )


def budget_for(gflops: float, flops_per_token: int) -> int:
    """The power of two of tokens nearest below STEP_TARGET_S of matmuls at `gflops`, clamped
    to [MIN_TOKENS, MAX_TOKENS]."""
    tokens = gflops * 1e9 * STEP_TARGET_S / max(1, flops_per_token)
    budget = MIN_TOKENS
    while budget * 2 <= min(tokens, MAX_TOKENS):
        budget *= 2
    return budget


def suggest(model: torch.nn.Module | None, device: torch.device, dtype: torch.dtype) -> int:
    """The budget this worker suggests (0 off the CPU, or with no model, as a simulated
    worker: the scheduler's default applies)."""
    if device.type != "cpu" or model is None:
        return 0
    gflops = matmul_gflops(dtype)
    flops = linear_flops_per_token(model)
    budget = budget_for(gflops, flops)
    log.info(
        "step budget: %d tokens (%s matmuls at %.0f GFLOP/s, %.0f MFLOP per token)",
        budget,
        str(dtype).removeprefix("torch."),
        gflops,
        flops / 1e6,
    )
    return budget
