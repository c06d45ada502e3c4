"""Two or more builds of the CPU kernels, timed in turns in one process:
`python scripts/kernel_ab.py {matmul,attention,engine} VARIANT VARIANT ...`.

A VARIANT is a folder holding the kernels' sources (services/worker/kernels, or a copy with
a change), then any extra compiler flags, in one argument: "services/worker/kernels",
"/tmp/old -DPREFETCH_TILES=0". Each is built as the worker builds its library (the same
flags and instruction set), loaded with ctypes, and run in rounds, alternating which goes
first, on the same inputs: on a host whose speed drifts by 10% from one minute to the next,
two builds timed in turns drift together, where runs one after the other do not. Prints each
build's median time and its ratio to the first's, after checking that the outputs agree.

- matmul: SmolLM2-135M's four packed matmuls of 30 layers (cold weights, on huge pages as the
  worker keeps them) and lm_head, at each row count of --rows, --dtype float32 or bfloat16
  (where a bfloat16 kernel is built);
- attention: a decode step's paged attention over 30 layers' caches (--batch requests of
  --keys keys, blocks scattered), --dtype float32 or bfloat16; with --queries N, each
  request's last N keys are its queries (a prompt chunk: --batch 4 --keys 128 --queries 128);
- engine: whole steps of the random SmolLM2-135M, one in-process Engine per build (its fast
  decoder on that build's kernels), stepped in turns: --batch decodes of 128-token prompts,
  then steps of four 128-token prompts (new ones each time); the check compares the prompt
  steps' greedy tokens (of the decode steps, only how many were made);
- elementwise: a step's element-wise kernels of 30 layers at each row count of --rows (two
  rms_norms with the residual, rope_store, silu_mul), --dtype float32 or bfloat16.
The commit messages of the kernels' changes quote its numbers."""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from services.worker import huge_pages, kernels
from services.worker.huge_pages import HugePageArena
from services.worker.kernels.matmul import MatmulKernels

LAYERS, HIDDEN, VOCAB = 30, 576, 49152
MATMULS = [(960, HIDDEN), (HIDDEN, HIDDEN), (3072, HIDDEN), (HIDDEN, 1536)]  # (n, k)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def build(variant: str) -> kernels.CpuKernels:
    """The variant built as the worker builds its library (kernels._build), into a folder of
    its own."""
    source, *flags = variant.split()
    level = kernels.capability()
    library = Path(tempfile.mkdtemp(prefix="kernel-ab-")) / "cpu_kernels.so"
    try:
        kernels._build(kernels._compiler() or "cc", level, library, Path(source), tuple(flags))
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"{variant}: the build failed\n{exc.stderr}") from exc
    return kernels.CpuKernels(ctypes.CDLL(str(library)), level)


def matmul_runs(
    builds: list[kernels.CpuKernels], rows: int, dtype: torch.dtype
) -> list[Callable[[], torch.Tensor]]:
    packer = builds[0].matmul  # one packed layout for every build
    arena = HugePageArena()  # on huge pages, as the worker keeps them (packed_linear.WEIGHTS)

    def packed(n: int, k: int) -> tuple[torch.Tensor, int, int]:
        return arena.keep(packer.pack((torch.randn(n, k) * 0.02).to(dtype))), n, k

    weights = [[packed(n, k) for n, k in MATMULS] for _ in range(LAYERS)]
    weights.append([packed(VOCAB, HIDDEN)])
    inputs = {k: torch.randn(rows, k).to(dtype) for _, k in MATMULS}

    def run(matmul: MatmulKernels) -> torch.Tensor:
        for layer in weights:
            for packed, n, k in layer:
                out = matmul.linear(inputs[k], packed, None, n)
        return out

    return [lambda m=b.matmul: run(m) for b in builds]


def attention_runs(
    builds: list[kernels.CpuKernels], batch: int, keys: int, queries: int, dtype: torch.dtype
) -> list[Callable[[], torch.Tensor]]:
    blocks_per_request = -(-keys // BLOCK)
    slots = batch * blocks_per_request * BLOCK
    caches = [  # on huge pages, as the worker allocates them (huge_pages.allocate)
        tuple(
            huge_pages.allocate((slots, KV_HEADS, HEAD_DIM), dtype, torch.device("cpu")).copy_(
                torch.randn(slots, KV_HEADS, HEAD_DIM)
            )
            for _ in range(2)
        )
        for _ in range(LAYERS)
    ]
    tables = torch.randperm(batch * blocks_per_request).view(batch, -1).contiguous()
    qkv = torch.randn(batch * queries, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    starts = torch.arange(batch + 1) * queries
    lengths = torch.full((batch,), keys)

    def run(ops: kernels.CpuKernels) -> torch.Tensor:
        for k_cache, v_cache in caches:
            out = ops.paged_attention(
                qkv, k_cache, v_cache, starts, lengths, tables, BLOCK, HEADS, 0.125, None
            )
        return out

    return [lambda o=b: run(o) for b in builds]


def elementwise_runs(
    builds: list[kernels.CpuKernels], rows: int, dtype: torch.dtype
) -> list[Callable[[], torch.Tensor]]:
    gate_up_width = MATMULS[2][0]
    x = torch.randn(rows, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)
    gate_up = torch.randn(rows, gate_up_width).to(dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    cos, sin = torch.randn(rows, HEAD_DIM).to(dtype), torch.randn(rows, HEAD_DIM).to(dtype)
    slots = torch.randperm(rows + BLOCK)[:rows]
    caches = [torch.zeros(rows + BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2)]

    def run(ops: kernels.CpuKernels) -> torch.Tensor:
        residual = torch.zeros_like(x)
        for _ in range(LAYERS):
            rotated = qkv.clone()
            ops.rope_store(rotated, cos, sin, *caches, slots, HEADS, BLOCK)
            normed = ops.rms_norm(x, weight, 1e-5, residual=residual)
            activated = ops.silu_mul(gate_up)
            normed = ops.rms_norm(normed, weight, 1e-5, residual=residual)
        parts = (rotated, *caches, normed, residual, activated)
        return torch.cat([part.flatten().float() for part in parts])

    return [lambda o=b: run(o) for b in builds]


def engine_runs(
    builds: list[kernels.CpuKernels], batch: int, rounds: int, dtype: torch.dtype
) -> tuple[list[Callable[[], torch.Tensor]], list[Callable[[], torch.Tensor]]]:
    """(a decode step of `batch` requests, a step of four prompts) per build: one Engine each,
    its model loaded while the kernels' loader hands it that build."""
    from services.bench.random_model import build_random_model
    from services.engine.engine import Engine
    from services.worker.loader import load_model

    path = build_random_model("smollm2-135m")
    engines = []
    for ops in builds:
        with mock.patch.object(kernels, "load", lambda ops=ops: ops):
            loaded = load_model(str(path), dtype=str(dtype).removeprefix("torch."))
        engines.append(Engine(loaded, compile=False))
    # new prompts at every call (a cached prefix would skip their work), the same sequence of
    # them for every engine
    generators = [torch.Generator().manual_seed(0) for _ in engines]

    def prompts(index: int, count: int) -> list[list[int]]:
        return torch.randint(5, 49000, (count, 128), generator=generators[index]).tolist()

    for index, engine in enumerate(engines):  # every request decoding from here on
        for ids in prompts(index, batch):
            engine.add(ids, rounds + 12)
        for _ in range(-(-batch * 128 // 512) + 4):
            engine.step()

    def decode_step(engine: Engine) -> torch.Tensor:
        engine.step()
        return torch.tensor([engine.stats.num_generated_tokens])

    def prompt_step(index: int) -> torch.Tensor:
        engine = engines[index]
        engine.run()  # the decodes' last tokens, at the first call
        return torch.tensor([out.token_ids for out in engine.generate(prompts(index, 4), 1)])

    return (
        [lambda e=e: decode_step(e) for e in engines],
        [lambda i=i: prompt_step(i) for i in range(len(engines))],
    )


def compare(title: str, variants: list[str], runs: list[Callable], rounds: int) -> None:
    outputs = [run().float() for run in runs]
    for variant, output in zip(variants[1:], outputs[1:]):
        difference = (output - outputs[0]).abs().max().item()
        print(f"{title}: {variant}: largest difference from the first {difference:.3g}")
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(rounds):
        order = range(len(runs)) if round_ % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            started = time.perf_counter()
            runs[i]()
            times[i].append((time.perf_counter() - started) * 1e3)
    first = statistics.median(times[0])
    for variant, spent in zip(variants, times):
        median = statistics.median(spent)
        print(
            f"{title}: {variant:40s} {median:7.2f} ms  x{median / first:.3f}"
            f"  ({min(spent):.2f}..{max(spent):.2f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=["matmul", "attention", "engine", "elementwise"])
    parser.add_argument("variants", nargs="+", help='a sources folder and flags: "DIR -DX=1"')
    parser.add_argument("--rows", default="1,16,32", help="matmul, elementwise: row counts")
    parser.add_argument("--batch", type=int, default=32, help="attention, engine: requests")
    parser.add_argument("--keys", type=int, default=160, help="attention: keys per request")
    parser.add_argument("--queries", type=int, default=1, help="attention: queries per request")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    builds = [build(variant) for variant in args.variants]
    print(f"{torch.get_num_threads()} threads, kernels {kernels.capability()}")
    dtype = getattr(torch, args.dtype)
    if args.kernel in ("matmul", "elementwise"):
        row_runs = matmul_runs if args.kernel == "matmul" else elementwise_runs
        for rows in (int(r) for r in args.rows.split(",")):
            compare(f"{rows} rows", args.variants, row_runs(builds, rows, dtype), args.rounds)
    elif args.kernel == "engine":
        decodes, prompts = engine_runs(builds, args.batch, args.rounds, dtype)
        compare(f"decode step, batch {args.batch}", args.variants, decodes, args.rounds)
        compare("step of four 128-token prompts", args.variants, prompts, args.rounds)
    else:
        runs = attention_runs(builds, args.batch, args.keys, args.queries, dtype)
        title = f"{args.batch}x{args.queries}x{args.keys} queries x keys"
        compare(title, args.variants, runs, args.rounds)


if __name__ == "__main__":
    main()
