"""`--compare-inprocess`: the same prompts through the in-process engine (scheduler and runner
by direct calls, no Redis, no HTTP), all queued at once: the broker path's ceiling.

The bench composes services, as the launcher and the engine do (tests/test_import_rule.py):
it imports the engine, only when asked to run it (the engine loads torch)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from services.bench.stats import Summary
from services.bench.workload import Case


class InProcess:
    """One in-process engine, loaded and warmed up once, run on workload after workload (the
    interleaved rounds of `--rounds` reuse it)."""

    def __init__(self, engine: Any, speculate: int) -> None:
        self.engine = engine
        self.speculate = speculate
        engine.add(engine.tokenizer.encode("Once upon a time").ids, 2)  # first forward pass
        engine.run()  # outside any timing

    def run(self, cases: list[Case], concurrency: int | None = None) -> dict[str, Any]:
        """Tokens/s on `cases`, at most `concurrency` requests in the engine at once (a new one
        as soon as one ends, like the server's closed loop; None: all at once)."""
        engine = self.engine
        tokenized = [engine.tokenizer.encode(case.prompt).ids for case in cases]
        stats = engine.stats
        before, gaps_before = stats.num_generated_tokens, len(stats.token_gaps)
        steps_before, drafts_before = stats.num_steps, stats.num_draft_tokens
        accepted_before = stats.num_accepted_tokens
        limit = concurrency or len(cases)
        waiting = list(zip(tokenized, cases, strict=True))[::-1]
        added = []
        started = time.perf_counter()
        while True:
            in_engine = engine.num_unfinished
            while waiting and in_engine < limit:
                ids, case = waiting.pop()
                added.append(engine.add(ids, case.max_new_tokens))
                in_engine += 1
            if not engine.step() and not waiting:
                break
        wall_s = time.perf_counter() - started
        for request_id in added:  # the outputs are not kept: the engine runs on
            engine.take(request_id)
        num_tokens = stats.num_generated_tokens - before
        return {
            "available": True,
            # what the engine computes in (the server's, as load_inprocess was asked)
            "dtype": str(engine.loaded.cache_shape.dtype).removeprefix("torch."),
            "tokens_per_s": round(num_tokens / wall_s, 1),
            "generated_tokens": num_tokens,
            "wall_s": round(wall_s, 3),
            "concurrency": limit,
            "itl": Summary.of(stats.token_gaps[gaps_before:]).as_ms(),
            # forward passes per generated token (1.0 without speculation when every step
            # decodes)
            "steps_per_token": round((stats.num_steps - steps_before) / max(1, num_tokens), 3),
            "speculate": self.speculate,
            # simulated forward passes of this many ms (--fake-step-ms), None: the model's
            "fake_step_ms": self.engine.fake_step_ms,
            "draft_tokens": stats.num_draft_tokens - drafts_before,
            "accepted_tokens": stats.num_accepted_tokens - accepted_before,
        }


def load_inprocess(
    model_dir: Path, speculate: int = 0, dtype: str = "auto", fake_step_ms: float | None = None
) -> InProcess:
    """The engine on `model_dir` in `dtype` (the server's, so that the two compare), or its
    simulated steps of `fake_step_ms`, warmed up."""
    from services.engine import Engine

    engine = Engine(str(model_dir), speculate=speculate, dtype=dtype, fake_step_ms=fake_step_ms)
    return InProcess(engine, speculate)


def run_ceiling(model_dir: Path) -> dict[str, Any]:
    """services.bench.ceiling's decode measurement on the in-process engine."""
    from services.bench.ceiling import decode_ceiling
    from services.engine import Engine

    return decode_ceiling(Engine, model_dir)
