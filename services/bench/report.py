"""Metrics of each level (from services.bench.client's LevelRun) as one JSON-ready dict, and
the text table printed to stdout.

Definitions: TTFT = first token event - send; ITL = gaps between consecutive token events,
pooled over every request of the level; E2E = last event - send; TPOT = (last token - first
token) / (tokens - 1) per request. Throughputs divide by the level's wall time (first send to
last answer); only successful requests count toward latencies and tokens."""

from __future__ import annotations

import math
import statistics
from typing import Any

from services.bench.ceiling import format_ceiling
from services.bench.client import LevelRun
from services.bench.stats import Summary
from shared.host import CpuDescription


def level_metrics(run: LevelRun) -> dict[str, Any]:
    ok = [r for r in run.records if r.is_ok]
    num_tokens = sum(r.num_tokens for r in ok)
    errors = sorted({r.error or "no tokens" for r in run.records if not r.is_ok})
    return {
        "mode": run.mode,
        "value": run.value,
        "num_requests": len(run.records),
        "num_completed": len(ok),
        "num_failed": len(run.records) - len(ok),
        "errors": errors[:5],
        "wall_s": round(run.wall_s, 3),
        "output_tokens": num_tokens,
        "request_throughput": round(len(ok) / run.wall_s, 3),  # completed requests/s
        "output_token_throughput": round(num_tokens / run.wall_s, 1),  # tokens/s
        "ttft": Summary.of([r.ttft_s for r in ok]).as_ms(),
        "itl": Summary.of([gap for r in ok for gap in r.itls_s]).as_ms(),
        "tpot": Summary.of([t for r in ok if (t := r.tpot_s) is not None]).as_ms(),
        "e2e": Summary.of([r.e2e_s for r in ok]).as_ms(),
        "cpu_pct": run.cpu_pct,  # % of one core per role during the level
    }


def _label(level: dict[str, Any]) -> str:
    if level["mode"] == "concurrency":
        return f"c={int(level['value'])}"
    return f"rate={level['value']:g}/s"


def _fmt(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1f}"


def format_table(report: dict[str, Any]) -> str:
    """Levels as rows: completed/sent, throughputs, then p50/p90/p99 of TTFT, ITL and E2E in
    ms; comparisons (when run) under it."""
    names = [f"{m} p{p}" for m in ("ttft", "itl", "e2e") for p in (50, 90, 99)]
    head = f"{'level':>10s} {'ok/n':>7s} {'req/s':>7s} {'tok/s':>8s}" + "".join(
        f" {name:>9s}" for name in names
    )
    lines = [f"model {report['model']}  workload {report['workload']}"]
    if "host" in report:
        lines.append(f"bench host {CpuDescription(**report['host']).line()}")
    lines.append(head)
    for level in report["levels"]:
        ok = f"{level['num_completed']}/{level['num_requests']}"
        row = (
            f"{_label(level):>10s} {ok:>7s} {level['request_throughput']:7.2f}"
            f" {level['output_token_throughput']:8.1f}"
        )
        for name in ("ttft", "itl", "e2e"):
            row += "".join(f" {_fmt(level[name][f'p{p}_ms']):>9s}" for p in (50, 90, 99))
        lines.append(row)
        lines += [f"{'':>10s} error: {error}" for error in level["errors"]]
    lines.append("(latencies in ms; tok/s = output tokens per second)")
    for level in report["levels"]:
        if level.get("cpu_pct"):
            used = "  ".join(f"{role} {pct:.1f}" for role, pct in level["cpu_pct"].items())
            lines.append(f"cpu % of one core {_label(level)}: {used}")
    for name, baseline in report.get("baselines", {}).items():
        lines.append(format_baseline(name, baseline, report["levels"]))
    for level in report.get("prefix_caching", {}).get("levels", []):
        lines.append(
            f"prefix caching {level['level']}: TTFT p50 {_fmt(level['ttft_p50_ms_cached'])} ms "
            f"cached vs {_fmt(level['ttft_p50_ms_uncached'])} ms uncached "
            f"(x{level['ttft_p50_ratio']}), outputs identical {level['outputs_identical']}"
        )
    lines += format_rounds(report.get("rounds"))
    if "ceiling" in report:
        lines.append(format_ceiling(report["ceiling"]))
    return "\n".join(lines)


def format_baseline(name: str, baseline: dict[str, Any], levels: list[dict[str, Any]]) -> str:
    if not baseline.get("available", True):
        return f"{name}: {baseline['message']}"
    tokens_per_s = baseline["tokens_per_s"]
    ratios = "  ".join(
        f"{_label(level)} x{level['output_token_throughput'] / tokens_per_s:.2f}"
        for level in levels
    )
    extra = f"  greedy equal {baseline['greedy_equal']}" if "greedy_equal" in baseline else ""
    if "steps_per_token" in baseline:
        extra += f"  forward passes/token {baseline['steps_per_token']:.3f}"
        if baseline.get("draft_tokens"):
            rate = baseline["accepted_tokens"] / baseline["draft_tokens"]
            extra += f" (speculate {baseline['speculate']}: {rate:.0%} of proposals accepted)"
    if "itl" in baseline:
        extra += f"  itl p50 {_fmt(baseline['itl']['p50_ms'])} ms" + "".join(
            f" ({_label(level)} {_signed(level['itl']['p50_ms'] - baseline['itl']['p50_ms'])})"
            for level in levels
            if level["itl"]["p50_ms"] is not None and baseline["itl"]["p50_ms"] is not None
        )
    if baseline.get("server_idle_cpu_pct"):
        extra += (
            "  (idle server meanwhile, cpu % of one core: "
            + "  ".join(
                f"{role} {pct:.1f}" for role, pct in baseline["server_idle_cpu_pct"].items()
            )
            + ")"
        )
    return f"{name}: {tokens_per_s:.1f} tok/s; server/{name}: {ratios}{extra}"


def round_record(
    index: int, seed: int, first: str, level: dict[str, Any], inprocess: dict[str, Any]
) -> dict[str, Any]:
    """One server/in-process pair of `--rounds`: the level's metrics against the engine's."""
    server_itl, inprocess_itl = level["itl"]["p50_ms"], inprocess["itl"]["p50_ms"]
    return {
        "round": index,
        "seed": seed,  # the synthetic workload's
        "first": first,  # "server" or "inprocess": which ran first
        "server_tokens_per_s": level["output_token_throughput"],
        "inprocess_tokens_per_s": inprocess["tokens_per_s"],
        "ratio": round(level["output_token_throughput"] / inprocess["tokens_per_s"], 3)
        if inprocess["tokens_per_s"]
        else None,
        "server_itl_p50_ms": server_itl,
        "inprocess_itl_p50_ms": inprocess_itl,
        "itl_p50_added_ms": round(server_itl - inprocess_itl, 2)
        if server_itl is not None and inprocess_itl is not None
        else None,
        "server_failed": level["num_failed"],
    }


def median_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, float | None]:
    """The median of each ratio over the rounds that have it."""

    def median(key: str) -> float | None:
        values = [r[key] for r in rounds if r[key] is not None]
        return round(statistics.median(values), 3) if values else None

    return {key: median(key) for key in ("ratio", "itl_p50_added_ms")}


def format_rounds(rounds: dict[str, Any] | None) -> list[str]:
    if not rounds:
        return []
    lines = []
    for r in rounds["rounds"]:
        lines.append(
            f"round {r['round']} (seed {r['seed']}, {r['first']} first): server "
            f"{r['server_tokens_per_s']:.1f} tok/s, in-process {r['inprocess_tokens_per_s']:.1f}"
            f" (x{r['ratio']}), itl p50 {_fmt(r['server_itl_p50_ms'])} vs "
            f"{_fmt(r['inprocess_itl_p50_ms'])} ms ({_signed(r['itl_p50_added_ms'])})"
        )
    median = rounds["median"]
    lines.append(
        f"median of {len(rounds['rounds'])} rounds: server/inprocess x{median['ratio']}, "
        f"itl p50 {_signed(median['itl_p50_added_ms'])} ms"
    )
    return lines


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def add_ratios(report: dict[str, Any]) -> None:
    """Each level's output tokens/s over each baseline's, into the level dicts."""
    for level in report["levels"]:
        level["ratio_vs"] = {
            name: round(level["output_token_throughput"] / baseline["tokens_per_s"], 2)
            for name, baseline in report.get("baselines", {}).items()
            if baseline.get("available", True) and baseline["tokens_per_s"] > 0
        }
        level["itl_p50_added_ms"] = {
            name: round(level["itl"]["p50_ms"] - baseline["itl"]["p50_ms"], 2)
            for name, baseline in report.get("baselines", {}).items()
            if "itl" in baseline
            and level["itl"]["p50_ms"] is not None
            and baseline["itl"]["p50_ms"] is not None
        }
