"""`textgen bench --constrained-share F`: what structured output costs everyone else.

Each closed-loop level runs four times on the same prompts: with no constraint, twice with a
share F of the requests under a JSON schema (TGI's `grammar`, spread evenly over the
workload), then plain again; each side's throughput is over its two runs. The
report gives the total token throughput of the constrained run over the plain one, the
inter-token latency p50 of the constrained requests over that of the unconstrained requests
of the same run, and what compiling a new schema takes for this model's tokenizer (the
worker's own compile path, timed here on a schema no cache has seen).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.bench.client import LevelRun
from services.bench.report import level_metrics
from services.bench.stats import Summary
from services.bench.workload import Case
from shared.grammar import compile_matcher, json_schema_constraint, load_tokenizer
from shared.model_files import eos_token_ids, vocab_size_of

# an API-style answer: bounded strings, an array, an integer with bounds
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 6},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "summary": {"type": "string", "maxLength": 300},
    },
    "required": ["title", "tags", "score", "summary"],
    "additionalProperties": False,
}


def constrained_indexes(num_cases: int, share: float) -> set[int]:
    """round(share * n) indexes spread evenly over the workload."""
    count = round(share * num_cases)
    return {int(i * num_cases / count) for i in range(count)} if count else set()


def with_constraints(cases: list[Case], share: float) -> list[Case]:
    marked = constrained_indexes(len(cases), share)
    grammar = {"type": "json", "value": SCHEMA}
    return [
        dataclasses.replace(case, grammar=grammar) if i in marked else case
        for i, case in enumerate(cases)
    ]


def compile_seconds(model_dir: Path, samples: int = 5) -> float:
    """Median seconds the worker's compile (shared.grammar.compile_matcher) takes for a schema
    it has not seen (one new property name per sample), the token table built beforehand as
    at worker start."""
    tokenizer = load_tokenizer(model_dir, vocab_size_of(model_dir), eos_token_ids(model_dir))
    times = []
    for _ in range(samples):
        fresh = {
            **SCHEMA,
            "properties": {**SCHEMA["properties"], uuid.uuid4().hex: {"type": "boolean"}},
        }
        started = time.perf_counter()
        compile_matcher(tokenizer, json_schema_constraint(fresh))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def compare(
    cases: list[Case],
    share: float,
    run_level: Callable[[list[Case], int, str], LevelRun],
    levels: list[int],
    model_dir: Path,
) -> dict[str, Any]:
    """Per concurrency level: the plain run, the constrained run and their ratios."""
    constrained = with_constraints(cases, share)
    marked = constrained_indexes(len(cases), share)
    results = []
    for level in levels:
        # plain, mixed, mixed, plain: a host that drifts during the level weighs on both alike
        plain_a = run_level(cases, level, f"c={level} plain")
        mixed_a = run_level(constrained, level, f"c={level} {share:.0%} constrained")
        mixed_b = run_level(constrained, level, f"c={level} {share:.0%} constrained")
        plain_b = run_level(cases, level, f"c={level} plain")
        plain_tok_s = mean_throughput(plain_a, plain_b)
        mixed_tok_s = mean_throughput(mixed_a, mixed_b)
        ok = [(i in marked, r) for run in (mixed_a, mixed_b) for i, r in enumerate(run.records)]
        ok = [(on, r) for on, r in ok if r.is_ok]
        itl_on = Summary.of([g for on, r in ok if on for g in r.itls_s]).as_ms()
        itl_off = Summary.of([g for on, r in ok if not on for g in r.itls_s]).as_ms()
        runs = (plain_a, mixed_a, mixed_b, plain_b)
        results.append(
            {
                "concurrency": level,
                "plain_tok_s": plain_tok_s,
                "mixed_tok_s": mixed_tok_s,
                "throughput_ratio": _ratio(mixed_tok_s, plain_tok_s),
                "itl_p50_constrained_ms": itl_on["p50_ms"],
                "itl_p50_unconstrained_ms": itl_off["p50_ms"],
                "itl_p50_ratio": _ratio(itl_on["p50_ms"], itl_off["p50_ms"]),
                "num_failed": sum(level_metrics(run)["num_failed"] for run in runs),
            }
        )
    return {
        "share": share,
        "schema": "title/tags/score/summary object (services/bench/constrained.py)",
        "compile_ms": round(compile_seconds(model_dir) * 1e3, 3),
        "levels": results,
    }


def mean_throughput(*runs: LevelRun) -> float:
    """Output tokens per second over the runs together."""
    tokens = sum(r.num_tokens for run in runs for r in run.records if r.is_ok)
    return round(tokens / sum(run.wall_s for run in runs), 1)


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value and base else None


def format_constrained(report: dict[str, Any]) -> list[str]:
    lines = [
        f"constrained share {report['share']:.0%} ({report['schema']}); "
        f"a new schema compiles in {report['compile_ms']:.2f} ms",
        f"{'level':>10s} {'plain tok/s':>12s} {'mixed tok/s':>12s} {'ratio':>6s} "
        f"{'ITL p50 constrained':>20s} {'unconstrained':>14s} {'ratio':>6s}",
    ]
    for level in report["levels"]:
        lines.append(
            f"{'c=' + str(level['concurrency']):>10s} {level['plain_tok_s']:12.1f} "
            f"{level['mixed_tok_s']:12.1f} {level['throughput_ratio'] or 0:6.3f} "
            f"{level['itl_p50_constrained_ms'] or 0:20.1f} "
            f"{level['itl_p50_unconstrained_ms'] or 0:14.1f} {level['itl_p50_ratio'] or 0:6.3f}"
        )
    return lines
