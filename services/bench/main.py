"""`textgen bench`: latency and throughput of the server under load, streamed.

Every request goes to /generate_stream (SSE, greedy), so each one yields its time to first
token, its inter-token latencies and its end-to-end latency (services.bench.timeline). Levels
run one after another on the same workload: a closed-loop concurrency sweep (`--concurrency`:
that many requests in flight until `--num-requests` are done) and open-loop Poisson arrivals
(`--request-rate`). The workload is synthetic (seeded prompt/output lengths, prompts built
from words against the model's tokenizer) or a JSON-lines `--dataset`.

Optional baselines on the same prompts: transformers' generate (`--compare-transformers`,
sequentially and as one static batch; greedy outputs compared token for token) and the
in-process engine (`--compare-inprocess`). The server is `--url`, else a `textgen launch` the
bench starts on a free port."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Coroutine
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.bench import cpu, lora
from services.bench.arrivals import poisson_arrivals
from services.bench.client import LevelRun, run_closed_loop, run_open_loop
from services.bench.constrained import compare as compare_constrained
from services.bench.constrained import format_constrained
from services.bench.flags import concurrency_levels
from services.bench.inprocess import load_inprocess, run_ceiling
from services.bench.placement import Placement
from services.bench.plot import MISSING, can_plot, plot
from services.bench.progress import Progress
from services.bench.report import (
    add_ratios,
    format_table,
    level_metrics,
    median_of_rounds,
    round_record,
)
from services.bench.server import Served, served_dtype, server
from services.bench.workload import (
    Case,
    dataset_workload,
    synthetic_workload,
    tokenizer_counter,
)
from shared import aio
from shared.host import describe_cpu
from shared.model_files import eos_token_ids, resolve_model_dir
from shared.openmp import share_cores


def build_workload(
    args: argparse.Namespace, model_dir: Path, seed: int | None = None
) -> tuple[list[Case], str]:
    """The cases and a one-line description of them (`seed`: instead of --seed)."""
    if args.dataset is not None:
        cases = dataset_workload(args.dataset, args.num_requests, args.output_len_range[1])
        return cases, f"{args.dataset} ({len(cases)} requests)"
    cases = synthetic_workload(
        args.num_requests,
        args.input_len_range,
        args.output_len_range,
        tokenizer_counter(model_dir),
        args.seed if seed is None else seed,
        args.shared_prefix_len,
    )
    (in_low, in_high), (out_low, out_high) = args.input_len_range, args.output_len_range
    prefix = f" shared prefix {args.shared_prefix_len}" if args.shared_prefix_len else ""
    return cases, (
        f"synthetic seed={args.seed}{prefix} input {in_low}:{in_high} output "
        f"{out_low}:{out_high} ({len(cases)} requests)"
    )


def run_levels(served: Served, cases: list[Case], args: argparse.Namespace) -> list[LevelRun]:
    show = not args.no_progress
    url, api = served.url, served.api
    runs = []
    aio.run(run_closed_loop(url, cases[:2], 2, api=api))  # warm-up, not reported
    for level in concurrency_levels(args):
        runs.append(closed_level(served, cases, level, f"c={level}", show))
    for rate in args.request_rate or []:
        bar = Progress(f"rate={rate:g}/s", len(cases)) if show else None
        send_times = poisson_arrivals(len(cases), rate, args.seed)
        on_done = bar.advance if bar else lambda: None
        sweep = run_open_loop(url, cases, rate, send_times, on_done, api=api)
        runs.append(_measured(served, sweep))
        if bar:
            bar.close()
    return runs


def closed_level(
    served: Served, cases: list[Case], concurrency: int, label: str, show: bool
) -> LevelRun:
    bar = Progress(label, len(cases)) if show else None
    on_done = bar.advance if bar else lambda: None
    level = run_closed_loop(served.url, cases, concurrency, on_done, api=served.api)
    run = _measured(served, level)
    if bar:
        bar.close()
    return run


def _measured(served: Served, level: Coroutine[Any, Any, LevelRun]) -> LevelRun:
    """Run one level (a coroutine not yet started) and record the CPU each part of the system
    used meanwhile."""
    before, started = cpu.snapshot(served.pid), time.perf_counter()
    with served.placement.client():
        run = aio.run(level)  # uvloop: the load generator takes less of the server's CPU
    run.cpu_pct = cpu.percent_of_core(
        before, cpu.snapshot(served.pid), time.perf_counter() - started
    )
    return run


def compare_transformers(
    model_dir: Path, cases: list[Case], first: LevelRun | None, dtype: str
) -> dict[str, dict[str, Any]]:
    """transformers in the dtype the server runs: one request at a time, and static batches
    as large as the first level's concurrency (each run to its longest request)."""
    from services.bench.reference import run_batched, run_sequential

    eos = eos_token_ids(model_dir)
    batch_size = int(first.value) if first is not None and first.mode == "concurrency" else 0
    sequential = run_sequential(str(model_dir), cases, eos, dtype)
    batched = run_batched(str(model_dir), cases, eos, dtype, batch_size or len(cases))
    out: dict[str, dict[str, Any]] = {}
    for name, result in (("hf_sequential", sequential), ("hf_batched", batched)):
        out[name] = {
            "tokens_per_s": round(result.tokens_per_s, 1),
            "generated_tokens": result.num_generated_tokens,
            "wall_s": round(result.wall_s, 3),
            "dtype": dtype,
        }
    out["hf_batched"]["batch_size"] = batch_size or len(cases)
    if first is not None:
        out["hf_sequential"]["greedy_equal"] = greedy_equal(first, sequential.token_ids)
    return out


def greedy_equal(run: LevelRun, token_ids: list[list[int]]) -> str:
    matches = sum(r.token_ids == ids for r, ids in zip(run.records, token_ids, strict=True))
    return f"{matches}/{len(token_ids)}"


def compare_prefix_caching(
    model_dir: Path, cases: list[Case], args: argparse.Namespace, cached: list[LevelRun]
) -> dict[str, Any]:
    """The same levels against a server with prefix caching off."""
    launch_args = [*args.launch_arg, "--disable-prefix-caching"]
    with server(None, str(model_dir), launch_args, placement=args.placement) as served:
        uncached = run_levels(served, cases, args)
    levels = []
    for on, off in zip(cached, uncached, strict=True):
        on_metrics, off_metrics = level_metrics(on), level_metrics(off)
        on_ttft, off_ttft = on_metrics["ttft"]["p50_ms"], off_metrics["ttft"]["p50_ms"]
        levels.append(
            {
                "level": f"{on.mode}={on.value:g}",
                "ttft_p50_ms_cached": on_ttft,
                "ttft_p50_ms_uncached": off_ttft,
                "ttft_p50_ratio": round(off_ttft / on_ttft, 2) if on_ttft else None,
                "tokens_per_s_uncached": off_metrics["output_token_throughput"],
                "outputs_identical": greedy_equal(on, [r.token_ids for r in off.records]),
            }
        )
    return {"levels": levels}


def compare_inprocess(
    served: Served,
    model_dir: Path,
    cases: list[Case],
    runs: list[LevelRun],
    args: argparse.Namespace,
    dtype: str,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The in-process baseline on the levels' workload, in the server's `dtype`, run while the
    launched server sits idle (its CPU meanwhile is reported), then rounds 1..N-1 of
    `--rounds`: the same engine and the server on a new workload each, in alternating order.
    Returns the baseline and every round (round 0: the levels' first and that baseline)."""
    first = runs[0] if runs and runs[0].mode == "concurrency" else None
    concurrency = int(first.value) if first else None
    compute = args.placement.compute
    with compute():
        inprocess = load_inprocess(model_dir, args.speculate, dtype, args.fake_step_ms)
    before, started = cpu.snapshot(served.pid), time.perf_counter()
    with compute():
        baseline = inprocess.run(cases, concurrency)
    idle = cpu.percent_of_core(before, cpu.snapshot(served.pid), time.perf_counter() - started)
    baseline["server_idle_cpu_pct"] = {k: v for k, v in idle.items() if k != "bench"}
    if first is None or args.rounds == 1:
        return baseline, []
    rounds = [round_record(0, args.seed, "server", level_metrics(first), baseline)]
    show, level_concurrency = not args.no_progress, int(first.value)
    for index in range(1, args.rounds):
        seed = args.seed + index
        round_cases, _ = build_workload(args, model_dir, seed)
        label = f"round {index} c={level_concurrency}"
        order = "inprocess" if index % 2 else "server"  # which side runs first alternates
        if order == "inprocess":
            with compute():
                measured = inprocess.run(round_cases, level_concurrency)
            level = closed_level(served, round_cases, level_concurrency, label, show)
        else:
            level = closed_level(served, round_cases, level_concurrency, label, show)
            with compute():
                measured = inprocess.run(round_cases, level_concurrency)
        rounds.append(round_record(index, seed, order, level_metrics(level), measured))
    return baseline, rounds


def _check_args(args: argparse.Namespace) -> str | None:
    """Why these flags cannot run together, or None."""
    if args.plot is not None and not can_plot():
        return MISSING
    if args.compare_prefix_caching and args.url:
        return "--compare-prefix-caching launches its servers: drop --url"
    if args.worker_cpus is not None:
        if args.url:
            return "--worker-cpus places a server the bench launches: drop --url"
        try:
            Placement(args.worker_cpus)
        except ValueError as exc:
            return str(exc)
    if not 0.0 <= args.constrained_share <= 1.0:
        return f"--constrained-share must be between 0 and 1, got {args.constrained_share}"
    if args.constrained_share and args.request_rate:
        return "--constrained-share compares closed-loop levels: drop --request-rate"
    if args.api == "openai" and (args.compare_transformers or args.constrained_share):
        return (
            "--api openai reads no token ids nor grammars: drop --compare-transformers and "
            "--constrained-share"
        )
    if args.compare_lora and (not args.lora or args.url):
        return "--compare-lora launches its servers with --lora adapters: add --lora N, drop --url"
    if args.lora < 0 or args.lora_rank < 1:
        return "--lora must be >= 0 and --lora-rank >= 1"
    if args.fake_step_ms is not None:
        if args.url:
            return "--fake-step-ms launches a simulated server: drop --url"
        if args.fake_step_ms < 0:
            return f"--fake-step-ms must be >= 0, got {args.fake_step_ms:g}"
        if args.compare_transformers or args.ceiling or args.speculate:
            return (
                "--fake-step-ms simulates the model: drop --compare-transformers, --ceiling "
                "and --speculate"
            )
    if args.rounds < 1:
        return f"--rounds must be at least 1, got {args.rounds}"
    if args.rounds > 1:
        if not args.compare_inprocess:
            return "--rounds pairs the server with the in-process engine: add --compare-inprocess"
        if args.concurrency is None or len(args.concurrency) != 1 or args.request_rate:
            return "--rounds needs exactly one --concurrency level and no --request-rate"
        if args.dataset is not None:
            return "--rounds draws a new synthetic workload each round: drop --dataset"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    args.placement = Placement(args.worker_cpus)
    # the baselines run with the OpenMP spin-wait `textgen launch` gives workers that share
    # their cores (set before anything imports torch)
    if "torch" not in sys.modules and args.placement.split is None:
        share_cores()
    if args.random_model:
        from services.bench.random_model import build_random_model

        model_dir = build_random_model(args.random_model)
    else:
        model_dir = resolve_model_dir(args.model_id)
    cases, workload = build_workload(args, model_dir)
    base_cases = cases
    if args.lora:
        folders = lora.adapter_folders(model_dir, args.lora, args.lora_rank)
        if not args.url:
            args.launch_arg = [*args.launch_arg, *lora.launch_args(folders, args.lora)]
        cases = lora.spread(cases, sorted(folders))
        warm_cases = lora.spread(build_workload(args, model_dir, args.seed + 1)[0], sorted(folders))
        workload += f", spread over {args.lora} LoRA adapters of rank {args.lora_rank}"
    if args.speculate:
        args.launch_arg = [*args.launch_arg, "--speculate", str(args.speculate)]
    if args.fake_step_ms is not None:
        args.launch_arg = [*args.launch_arg, "--fake-step-ms", str(args.fake_step_ms)]
    inprocess_baseline: dict[str, Any] = {}
    rounds: list[dict[str, Any]] = []
    with server(
        args.url, str(model_dir), args.launch_arg, placement=args.placement, api=args.api
    ) as served:
        dtype = served_dtype(served.url) or "float32"
        if args.compare_lora:  # a fresh server's first level also pays its first-use costs
            run_levels(served, warm_cases, args)  # other prompts: no prefix-cache hits later
        runs = run_levels(served, cases, args) if not args.constrained_share else []
        if args.constrained_share:
            show = not args.no_progress

            def level(level_cases: list[Case], concurrency: int, label: str) -> LevelRun:
                return closed_level(served, level_cases, concurrency, label, show)

            aio.run(run_closed_loop(served.url, cases[:2], 2, api=served.api))  # warm-up
            constrained = compare_constrained(
                cases, args.constrained_share, level, concurrency_levels(args), model_dir
            )
        if args.compare_inprocess:
            inprocess_baseline, rounds = compare_inprocess(
                served, model_dir, cases, runs, args, dtype
            )
        base_runs = run_levels(served, base_cases, args) if args.compare_lora else []
    report: dict[str, Any] = {
        "model": args.model_id or f"random {args.random_model}",
        "dtype": dtype,
        "url": args.url or "launched",
        "workload": workload,
        # the machine the load generator ran on (and the server, where it launched one)
        "host": asdict(describe_cpu()),
        "levels": [level_metrics(r) for r in runs],
        "baselines": {},
    }
    if args.compare_transformers:
        with args.placement.compute():
            report["baselines"].update(
                compare_transformers(model_dir, cases, runs[0] if runs else None, dtype)
            )
    if args.compare_inprocess:
        report["baselines"]["inprocess"] = inprocess_baseline
        if rounds:
            report["rounds"] = {"rounds": rounds, "median": median_of_rounds(rounds)}
    add_ratios(report)
    if args.constrained_share:
        report["constrained"] = constrained
    if args.compare_lora:
        one_launch = [*args.launch_arg, "--max-loras", "1"]  # the last --max-loras wins
        with server(
            None, str(model_dir), one_launch, placement=args.placement, api=args.api
        ) as one:
            run_levels(one, warm_cases, args)  # warm, as the first server was
            one_runs = run_levels(one, cases, args)
        report["lora"] = lora.compare(
            report["levels"],
            [level_metrics(r) for r in base_runs],
            [level_metrics(r) for r in one_runs],
        )
    if args.compare_prefix_caching:
        report["prefix_caching"] = compare_prefix_caching(model_dir, cases, args, runs)
    if args.ceiling:
        with args.placement.compute():
            report["ceiling"] = run_ceiling(model_dir)
    if args.plot is not None:
        plot(report, args.plot)
    text = format_table(report)
    if args.constrained_share:
        text += "\n" + "\n".join(format_constrained(report["constrained"]))
    if args.compare_lora:
        text += "\n" + "\n".join(lora.format_lora(report["lora"]))
    print(json.dumps(report) if args.json else text)
    levels = report["levels"] + report.get("constrained", {}).get("levels", [])
    return 0 if all(level["num_failed"] == 0 for level in levels) else 1
