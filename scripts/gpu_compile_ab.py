"""torch.compile off and on, in process, on a GPU (issue 22): for each, the batch-1 decode step
against the HBM roofline (the whole engine step with its host time by operator, and the graph
replay alone) with its kernels' device times (the decode rows' keys split in ranges, then
not), a batch-32 decode step, the first token of one 128-token prompt (a mixed-step graph's
replay, or an eager step) with its host time by operator, and the first tokens of 32 such
prompts in one step, their attention through the Triton tile kernel and through SDPA (with that
step's kernels). JSON objects on stdout, the last one whole. AB_MODES: which modes to run
("eager,compiled"; "unfused" is compiled with the q/k/v and gate/up projections apart, as
before services/worker/fused_layers.py; "tuned" is compiled with inductor's autotuning of its
matmuls (Triton templates against cuBLAS) and coordinate-descent tuning of its own kernels,
which the batch-1 graph, compiled for its static shape, gets).

    [AB_MODES=eager] python3 scripts/gpu_compile_ab.py [SHAPE]   # default llama-3.2-1b
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import logging
import os
import sys
import time

import torch

from services.bench.ceiling import memory_roofline, timed_decode_steps
from services.bench.random_model import build_random_model
from services.engine import Engine
from services.worker import triton_attention
from services.worker.loader import load_model

KV_CACHE_BYTES = 8_000_000_000  # each engine's cache (the two load one after the other)
SALTS = itertools.count()  # every prompt of the run its own: no prefix-cache hit across calls


def first_token_ms(engine: Engine, vocab: int, count: int = 1, repeats: int = 5) -> float:
    """Best of `repeats` rounds of `count` 128-token prompts added together, to their first
    tokens; every prompt of the run distinct (no prefix-cache hit: an earlier A/B timed SDPA on
    the prompts the tile kernel had just cached)."""
    best = float("inf")
    for _ in range(repeats):
        salt = next(SALTS)
        prompts = [
            [(97 * salt + 31 * j + 7 * i) % (vocab - 3) + 3 for j in range(128)]
            for i in range(count)
        ]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        for prompt in prompts:
            engine.add(prompt, 1)
        engine.run()
        best = min(best, time.perf_counter() - started)
    return round(best * 1000, 3)


def kernel_times(backend, kv_cache, steps: int = 10, top: int = 25) -> list[list]:
    """The batch-1 step's kernels run outside a graph (the same kernels a replay launches),
    under torch.profiler: [name, calls per step, device µs per step], the most costly first."""
    step = backend.step_function(kv_cache, 1)  # its rows write the spare block
    with torch.inference_mode():
        step()
        return profiled(step, steps, top)


def profiled(work, steps: int, top: int, host: bool = False) -> list[list]:
    """`work` run `steps` times under torch.profiler: [name, calls per run, device µs per
    run] of its `top` most costly operators and kernels (`host`: [name, calls per run, host
    µs per run of the operator's own time], the costliest on the CPU side first)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch.inference_mode():
        with profile(activities=activities) as prof:
            for _ in range(steps):
                work()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        spent = event.self_cpu_time_total if host else event.self_device_time_total
        if spent:
            rows.append([event.key[:80], event.count // steps, round(spent / steps, 1)])
    return sorted(rows, key=lambda row: -row[2])[:top]


def decode_step_host(engine: Engine, vocab: int, steps: int = 20) -> list[list]:
    """Host time by operator of a batch-1 decode step (the engine's whole step around the
    graph replay: what the step's time has beyond the replay's), after its prompt."""
    engine.add([(13 * j) % (vocab - 3) + 3 for j in range(256)], max_new_tokens=steps + 40)
    for _ in range(4):  # the prompt, then decodes
        engine.step()
    rows = profiled(engine.step, steps, 30, True)
    engine.run()
    return rows


def measure(folder: str, mode: str, result: dict, report: dict) -> None:
    """The A/B's numbers of one mode into `result` (part of `report`, printed once the host
    profile is in, so that a run cut short still tells where an eager step's time goes)."""
    started = time.perf_counter()
    import torch._inductor.config as inductor_config  # the "tuned" mode's switches

    inductor_config.max_autotune_gemm = inductor_config.coordinate_descent_tuning = (
        mode == "tuned"
    )
    loaded = load_model(folder, fuse_projections=mode != "unfused")
    result["fused"] = loaded.projections_fused
    engine = Engine(loaded, compile=mode != "eager", kv_cache_memory=KV_CACHE_BYTES)
    result["load_s"] = round(time.perf_counter() - started, 1)
    backend = engine.runner.backend
    result["compiled"] = bool(getattr(backend, "compile", False))
    vocab = engine.tokenizer.get_vocab_size()
    result["first_token_ms"] = first_token_ms(engine, vocab)
    # one prompt's first token: an eager step took ~11 ms on an H200 against ~2.4 ms for a
    # batch-32 decode replay; where its host time goes (a mixed-step graph's replay now)
    result["eager_step_host"] = profiled(
        functools.partial(first_token_ms, engine, vocab, 1, 1), 3, 30, True
    )
    print(json.dumps(report), flush=True)
    if hasattr(backend, "tiles"):  # CudaPaged
        # 32 prompts in one step: their chunks attended as tiles by the Triton kernel, then
        # (the check's answer forced) one request at a time through SDPA
        tiles, times, kernels = backend.tiles, {}, {}
        for name, use in (("tiles", tiles), ("sdpa", False)):
            backend.tiles = use
            times[name] = first_token_ms(engine, vocab, 32, 3)
            kernels[name] = profiled(functools.partial(first_token_ms, engine, vocab, 32, 1), 1, 12)
        backend.tiles = tiles
        result["first_tokens_32_prompts_ms"] = times
        result["prompts32_kernels"] = kernels
    result["roofline_batch1"] = memory_roofline(engine, 256)
    result["decode_step_host"] = decode_step_host(engine, vocab)
    print(json.dumps(report), flush=True)
    prompts = [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(256)] for i in range(32)]
    step_s, sizes = timed_decode_steps(engine, prompts, 16)
    result["decode_batch32_ms"] = round(step_s * 1000, 3)
    result["batch32_requests_per_step"] = min(sizes)
    result["graph_steps"] = backend.graph_steps
    result["compiled_steps"] = backend.compiled_steps
    if getattr(backend, "graphs", None) and 1 in backend.graphs:
        result["batch1_kernels"] = kernel_times(backend, engine.runner.kv_cache)
        # the same with each decode row's keys in one range (the rows kernel unsplit)
        splits = triton_attention.num_splits
        triton_attention.num_splits = lambda rows, heads: 1
        try:
            result["batch1_kernels_unsplit"] = kernel_times(backend, engine.runner.kv_cache)
        finally:
            triton_attention.num_splits = splits
    del engine, backend
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    # to stderr: how long compiling and capturing took ("decode step compiled in ...")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
    started = time.perf_counter()
    folder = str(build_random_model(shape))
    report: dict = {
        "shape": shape,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "build_s": round(time.perf_counter() - started, 1),
    }
    modes = os.environ.get("AB_MODES", "eager,compiled").split(",")
    for mode in modes:
        report[mode] = {}
        measure(folder, mode, report[mode], report)
        print(json.dumps(report), flush=True)  # what is done so far, should a limit end it


if __name__ == "__main__":
    main()
