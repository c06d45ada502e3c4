"""Where a CPU step's time goes, in process: `python scripts/cpu_step_split.py [DTYPE]`.

Runs the random SmolLM2-135M (built once, as `textgen bench --random-model` builds it) on the
in-process engine with the fast decoder, and times every packed matmul (by rows, in, out) and
every CPU kernel call of
- a batch-32 decode step (32 prompts of 128 tokens, then 20 steps), and
- a step of four 128-token prompts,
- and with --long N, one prompt of N tokens (all its prompt steps: the engine splits it into
  chunks, whose attention is timed as attend_dense),
per step (or prompt), against its whole time; the rest is Python and torch glue. The numbers in
the kernels' comments and in the closing notes of issue 19 come from it."""

from __future__ import annotations

import argparse
import collections
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from services.bench.random_model import build_random_model
from services.engine.engine import Engine
from services.worker import fast_decoder, kernels, packed_linear

KERNELS = ("rms_norm", "rope_store", "silu_mul", "greedy", "paged_attention")
BATCH, PROMPT, DECODE_STEPS = 32, 128, 20


class Timers:
    """Seconds spent per key while on."""

    def __init__(self) -> None:
        self.seconds: dict[Any, float] = collections.defaultdict(float)
        self.on = False

    def wrap(self, function: Callable, key: Callable[..., Any]) -> Callable:
        def timed(*args, **kwargs):
            if not self.on:
                return function(*args, **kwargs)
            started = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds[key(*args)] += time.perf_counter() - started
            return result

        return timed

    def report(self, title: str, steps: int, seconds: float, unit: str = "step") -> None:
        measured = sum(self.seconds.values())
        per_step = seconds / steps * 1e3
        print(f"{title}: {per_step:.1f} ms per {unit}, timed {measured / steps * 1e3:.1f}")
        for key, spent in sorted(self.seconds.items(), key=lambda item: -item[1]):
            print(f"  {key!s:28} {spent / steps * 1e3:8.2f} ms")
        self.seconds.clear()


def prompts(count: int, length: int = PROMPT) -> list[list[int]]:
    return [[random.randrange(5, 1000) for _ in range(length)] for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dtype", nargs="?", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--long", type=int, default=0, help="also one prompt of this many tokens")
    args = parser.parse_args()
    random.seed(0)
    timers = Timers()
    linear = packed_linear.PackedLinear.__call__
    packed_linear.PackedLinear.__call__ = timers.wrap(
        linear, lambda self, x: ("matmul", x.shape[0] > 64, self.in_features, self.out_features)
    )
    fused = packed_linear.PackedLinear.silu_mul  # a gate/up matmul with silu_mul in it
    packed_linear.PackedLinear.silu_mul = timers.wrap(
        fused,
        lambda self, x, ops: ("matmul+silu", x.shape[0] > 64, self.in_features, self.out_features),
    )
    for name in KERNELS:
        kernel = getattr(kernels.CpuKernels, name)
        setattr(kernels.CpuKernels, name, timers.wrap(kernel, lambda *_, n=name: n))
    # long prompt chunks' attention (dense_prefill.py: AMX tiles or torch's fused attention)
    fast_decoder.attend_dense = timers.wrap(fast_decoder.attend_dense, lambda *_: "attend_dense")
    engine = Engine(str(build_random_model("smollm2-135m")), dtype=args.dtype, compile=False)
    print(f"{torch.get_num_threads()} threads, kernels {kernels.load().level}")
    for request in prompts(BATCH):
        engine.add(request, 10 + DECODE_STEPS)
    while engine.stats.num_generated_tokens < BATCH:  # every prompt in, decoding from here
        engine.step()
    for _ in range(5):
        engine.step()
    timers.on, started = True, time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    timers.report(f"decode, batch {BATCH}", DECODE_STEPS, time.perf_counter() - started)
    timers.on = False
    engine.run()  # the batch's last tokens
    engine.generate(prompts(4), 1)  # warm
    timers.on, started = True, time.perf_counter()
    for _ in range(3):
        engine.generate(prompts(4), 1)
    timers.report(f"4 prompts of {PROMPT} tokens", 3, time.perf_counter() - started)
    if args.long:
        timers.on = False
        engine.generate(prompts(1, args.long), 1)  # warm
        timers.on, started = True, time.perf_counter()
        for _ in range(3):
            engine.generate(prompts(1, args.long), 1)
        seconds = time.perf_counter() - started
        timers.report(f"1 prompt of {args.long} tokens", 3, seconds, unit="prompt")


if __name__ == "__main__":
    main()
