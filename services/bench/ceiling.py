"""`--ceiling`: how close a decode step comes to the machine's matmul ceiling.

A decode step at batch B does 2 * (weights of every linear layer, lm_head included) * B
floating-point operations plus the attention's 4 * context * heads * head_dim per layer and
token. The ceiling is the rate of one large square matmul in the model's dtype on this
machine (torch's own best case); the fraction is the step's rate over that. Both are measured
in this process, one after the other, on the in-process engine (services.bench.inprocess)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

MATMUL_SIZE = 2048  # of the square matmul that sets the ceiling


def matmul_ceiling_gflops(dtype: Any, repeats: int = 10) -> float:
    """GFLOP/s of a MATMUL_SIZE^3 matmul in `dtype` (best of `repeats`)."""
    import torch

    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(dtype)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(dtype)
    best = float("inf")
    for _ in range(repeats + 2):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * MATMUL_SIZE**3 / best / 1e9


def flops_per_token(model: Any, context_len: int) -> float:
    """Floating-point operations of one decoded token at `context_len`."""
    import torch

    linear = sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 4 * context_len * config.num_attention_heads * head_dim * config.num_hidden_layers
    return 2 * linear + attention


def decode_ceiling(
    engine_class: Any, model_dir: Path, batch: int = 32, context_len: int = 256, steps: int = 8
) -> dict[str, Any]:
    """Time `steps` decode steps with `batch` requests of `context_len` prompt tokens each."""
    engine = engine_class(str(model_dir))
    model = engine.loaded.model
    vocab = engine.tokenizer.get_vocab_size()
    for i in range(batch):
        prompt = [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(context_len)]
        engine.add(prompt, max_new_tokens=steps + 4)
    while engine.stats.num_generated_tokens < 2 * batch:  # every prompt is in the cache
        engine.step()
    before = engine.stats.num_steps
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_s = (time.perf_counter() - started) / (engine.stats.num_steps - before)
    sizes = engine.stats.step_sizes[before:]
    engine.run()
    achieved = flops_per_token(model, context_len + 4) * batch / step_s / 1e9
    ceiling = matmul_ceiling_gflops(model.dtype)
    return {
        "batch": batch,
        "context_len": context_len,
        "dtype": str(model.dtype).removeprefix("torch."),
        "step_ms": round(step_s * 1000, 2),
        "requests_per_step": min(sizes),
        "achieved_gflops": round(achieved, 1),
        "matmul_ceiling_gflops": round(ceiling, 1),
        "fraction": round(achieved / ceiling, 3),
    }


def format_ceiling(result: dict[str, Any]) -> str:
    if not result.get("available", True):
        return f"decode ceiling: {result['message']}"
    return (
        f"decode ceiling: batch {result['batch']} at {result['context_len']} tokens "
        f"({result['dtype']}): {result['step_ms']:.1f} ms/step, {result['achieved_gflops']:.0f} "
        f"GFLOP/s = {result['fraction']:.2f} of the {MATMUL_SIZE}^3 matmul ceiling "
        f"({result['matmul_ceiling_gflops']:.0f} GFLOP/s)"
    )
