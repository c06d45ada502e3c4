"""`--ceiling`: how close a decode step comes to the machine's matmul and memory ceilings.

A decode step at batch B does 2 * (weights of every linear layer, lm_head included) * B
floating-point operations plus the attention's 4 * context * heads * head_dim per layer and
token. The ceiling is the rate of one large square matmul in the model's dtype on this
machine (torch's own best case); the fraction is the step's rate over that. Both are measured
in this process, one after the other, on the in-process engine (services.bench.inprocess).

At batch 1 a decode step is bound by memory instead: it reads every weight once (tied
embeddings counted once) and the request's cached keys and values. The roofline fraction is
those bytes per step time over the bandwidth of one large device-to-device copy (bytes read
plus written), measured here too."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

MATMUL_SIZE = 2048  # of the square matmul that sets the ceiling


COPY_BYTES = 1 << 30  # of the copy that sets the memory ceiling


def _best_seconds(work: Any, device: Any, repeats: int) -> float:
    """The fastest of `repeats` runs of `work` (after two warm-ups), waited for on `device`."""
    import torch

    best = float("inf")
    for _ in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def matmul_ceiling_gflops(dtype: Any, device: Any = "cpu", repeats: int = 10) -> float:
    """GFLOP/s of a MATMUL_SIZE^3 matmul in `dtype` on `device` (best of `repeats`)."""
    import torch

    device = torch.device(device)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(device, dtype)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(device, dtype)
    return 2 * MATMUL_SIZE**3 / _best_seconds(lambda: torch.mm(a, b), device, repeats) / 1e9


def copy_bandwidth_gbs(device: Any, num_bytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """GB/s (read + written) of one `num_bytes` copy on `device` (best of `repeats`)."""
    import torch

    device = torch.device(device)
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    return 2 * num_bytes / _best_seconds(lambda: target.copy_(source), device, repeats) / 1e9


def bytes_per_step(model: Any, bytes_per_token: int, context_len: int) -> int:
    """Bytes one batch-1 decode step reads: every distinct weight, and the cached context."""
    storages = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    weights = sum(p.numel() * p.element_size() for p in storages.values())
    return weights + bytes_per_token * context_len


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
    prompts = [
        [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(context_len)] for i in range(batch)
    ]
    step_s, sizes = timed_decode_steps(engine, prompts, steps)
    achieved = flops_per_token(model, context_len + 4) * batch / step_s / 1e9
    ceiling = matmul_ceiling_gflops(model.dtype, engine.loaded.device)
    return {
        "batch": batch,
        "context_len": context_len,
        "dtype": str(model.dtype).removeprefix("torch."),
        "step_ms": round(step_s * 1000, 2),
        "requests_per_step": min(sizes),
        "achieved_gflops": round(achieved, 1),
        "matmul_ceiling_gflops": round(ceiling, 1),
        "fraction": round(achieved / ceiling, 3),
        "roofline": memory_roofline(engine, context_len),
    }


def timed_decode_steps(engine: Any, prompts: list[list[int]], steps: int) -> tuple[float, list]:
    """Seconds per step of `steps` decode steps of `prompts` on `engine` (timed once each has
    its prompt in the cache and a first decode done), and the steps' sizes; then runs them
    out."""
    generated = engine.stats.num_generated_tokens
    for prompt in prompts:
        engine.add(prompt, max_new_tokens=steps + 8)
    while engine.stats.num_generated_tokens < generated + 2 * len(prompts):
        engine.step()
    before = engine.stats.num_steps
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_s = (time.perf_counter() - started) / (engine.stats.num_steps - before)
    sizes = engine.stats.step_sizes[before:]
    engine.run()
    return step_s, sizes


def memory_roofline(engine: Any, context_len: int, steps: int = 32) -> dict[str, Any]:
    """Time batch-1 decode steps of one request of `context_len` prompt tokens on `engine`."""
    vocab = engine.tokenizer.get_vocab_size()
    prompt = [(11 * j) % (vocab - 3) + 3 for j in range(context_len)]
    step_s, _ = timed_decode_steps(engine, [prompt], steps)
    loaded = engine.loaded
    moved = bytes_per_step(loaded.model, loaded.cache_shape.bytes_per_token, context_len + steps)
    bandwidth = copy_bandwidth_gbs(loaded.device)
    result = {
        "step_ms": round(step_s * 1000, 3),
        "bytes_per_step": moved,
        "achieved_gbs": round(moved / step_s / 1e9, 1),
        "copy_gbs": round(bandwidth, 1),
        "fraction": round(moved / step_s / 1e9 / bandwidth, 3),
    }
    backend = engine.runner.backend
    if 1 in getattr(backend, "graphs", {}):  # CUDA: the batch-1 forward pass alone
        forward_s = replay_seconds(backend, 1)
        result["forward_ms"] = round(forward_s * 1000, 3)
        result["forward_fraction"] = round(moved / forward_s / 1e9 / bandwidth, 3)
    return result


def replay_seconds(backend: Any, size: int, repeats: int = 50) -> float:
    """Mean seconds of one replay of a CudaPaged backend's `size`-row decode graph alone (no
    step around it), its rows writing the spare block: the forward pass's own time on the
    device."""
    import torch  # the worker's side: not on the bench's import path

    backend.static["slot_mapping"][:size].fill_(backend.spare_slot)
    graph, _ = backend.graphs[size]
    graph.replay()
    torch.cuda.synchronize(backend.device)
    started = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize(backend.device)
    return (time.perf_counter() - started) / repeats


def format_ceiling(result: dict[str, Any]) -> str:
    if not result.get("available", True):
        return f"decode ceiling: {result['message']}"
    text = (
        f"decode ceiling: batch {result['batch']} at {result['context_len']} tokens "
        f"({result['dtype']}): {result['step_ms']:.1f} ms/step, {result['achieved_gflops']:.0f} "
        f"GFLOP/s = {result['fraction']:.2f} of the {MATMUL_SIZE}^3 matmul ceiling "
        f"({result['matmul_ceiling_gflops']:.0f} GFLOP/s)"
    )
    roofline = result.get("roofline")
    if roofline:
        text += (
            f"\nmemory roofline: batch 1, {roofline['step_ms']:.3f} ms/step reading "
            f"{roofline['bytes_per_step'] / 1e6:.0f} MB = {roofline['achieved_gbs']:.0f} GB/s, "
            f"{roofline['fraction']:.2f} of a device copy's {roofline['copy_gbs']:.0f} GB/s"
        )
        if "forward_ms" in roofline:
            text += (
                f"; the forward pass alone (its CUDA graph) {roofline['forward_ms']:.3f} ms = "
                f"{roofline['forward_fraction']:.2f}"
            )
    return text
