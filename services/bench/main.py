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
from pathlib import Path
from typing import Any

from services.bench import cpu
from services.bench.arrivals import poisson_arrivals
from services.bench.client import LevelRun, run_closed_loop, run_open_loop
from services.bench.inprocess import load_inprocess, run_ceiling
from services.bench.placement import Placement
from services.bench.plot import MISSING, can_plot, plot
from services.bench.progress import Progress
from services.bench.random_model import SHAPES
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
    parse_range,
    synthetic_workload,
    tokenizer_counter,
)
from shared import aio
from shared.model_files import eos_token_ids, resolve_model_dir
from shared.openmp import share_cores

DEFAULT_CONCURRENCY = "1,4,16,32"


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16, got {text!r}")
    return values


def _rates(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive rates like 2,8, got {text!r}")
    return values


def _range(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-id", help="model folder or hub id")
    model.add_argument(
        "--random-model",
        choices=sorted(SHAPES),
        help="a random-weight model of that checkpoint's shape, built once into "
        "~/.cache/textgen/random-models (no download)",
    )
    parser.add_argument("--url", help="a running server; default: launch one")
    parser.add_argument(
        "--num-requests", type=int, default=32, help="requests per level (default 32)"
    )
    parser.add_argument(
        "--concurrency",
        type=_ints,
        help=f"closed-loop levels, e.g. 1,4,16 (default {DEFAULT_CONCURRENCY} "
        "unless --request-rate is given)",
    )
    parser.add_argument(
        "--request-rate", type=_rates, help="open-loop Poisson levels in requests/s, e.g. 2,8"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival times")
    parser.add_argument(
        "--input-len-range",
        type=_range,
        default=(32, 256),
        help="prompt tokens LOW:HIGH (default 32:256)",
    )
    parser.add_argument(
        "--output-len-range",
        type=_range,
        default=(16, 128),
        help="max_new_tokens LOW:HIGH (default 16:128)",
    )
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        metavar="N",
        help="every synthetic prompt starts with the same N tokens (prefix caching)",
    )
    parser.add_argument(
        "--dataset",
        type=Path,
        help='JSON lines of {"prompt": ..., "max_new_tokens": ...} instead of synthetic prompts',
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="needs matplotlib")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--compare-transformers",
        action="store_true",
        help="transformers generate on the same prompts (sequential and one static batch)",
    )
    parser.add_argument(
        "--compare-inprocess", action="store_true", help="the in-process engine, when present"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="with --compare-inprocess and one --concurrency level: N server/in-process "
        "pairs in alternating order (server first, then in-process first, ...), round i on "
        "a synthetic workload seeded seed+i; ratios per round and their median (a noisy "
        "host drifts between two phases of one round less than across a whole run)",
    )
    parser.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="the same levels on a second launched server with --disable-prefix-caching: "
        "TTFT ratio and identical outputs (use with --shared-prefix-len)",
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="time in-process decode steps at batch 32 against this machine's matmul ceiling",
    )
    parser.add_argument(
        "--speculate",
        type=int,
        default=0,
        metavar="N",
        help="n-gram speculation on the launched server and the in-process engine",
    )
    parser.add_argument(
        "--worker-cpus",
        metavar="CPUS",
        help="launch the server with --worker-cpus CPUS (e.g. 0): its workers compute there, "
        "its other services on the other CPUs; the in-process engine, transformers and the "
        "ceiling then compute on CPUS too, and the load generator runs on the others",
    )
    parser.add_argument(
        "--launch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to the launched server (repeat: --launch-arg=--max-batch-size "
        "--launch-arg=16)",
    )


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


def _concurrency_levels(args: argparse.Namespace) -> list[int]:
    if args.concurrency is None and args.request_rate is None:
        return _ints(DEFAULT_CONCURRENCY)
    return args.concurrency or []


def run_levels(served: Served, cases: list[Case], args: argparse.Namespace) -> list[LevelRun]:
    show = not args.no_progress
    url = served.url
    runs = []
    aio.run(run_closed_loop(url, cases[:2], 2))  # warm-up, not reported
    for level in _concurrency_levels(args):
        runs.append(closed_level(served, cases, level, f"c={level}", show))
    for rate in args.request_rate or []:
        bar = Progress(f"rate={rate:g}/s", len(cases)) if show else None
        send_times = poisson_arrivals(len(cases), rate, args.seed)
        on_done = bar.advance if bar else lambda: None
        runs.append(_measured(served, run_open_loop(url, cases, rate, send_times, on_done)))
        if bar:
            bar.close()
    return runs


def closed_level(
    served: Served, cases: list[Case], concurrency: int, label: str, show: bool
) -> LevelRun:
    bar = Progress(label, len(cases)) if show else None
    on_done = bar.advance if bar else lambda: None
    run = _measured(served, run_closed_loop(served.url, cases, concurrency, on_done))
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
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The in-process baseline on the levels' workload, run while the launched server sits
    idle (its CPU meanwhile is reported), then rounds 1..N-1 of `--rounds`: the same engine
    and the server on a new workload each, in alternating order. Returns the baseline and
    every round (round 0: the levels' first and that baseline)."""
    first = runs[0] if runs and runs[0].mode == "concurrency" else None
    concurrency = int(first.value) if first else None
    compute = args.placement.compute
    with compute():
        inprocess = load_inprocess(model_dir, args.speculate)
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
    if args.speculate:
        args.launch_arg = [*args.launch_arg, "--speculate", str(args.speculate)]
    inprocess_baseline: dict[str, Any] = {}
    rounds: list[dict[str, Any]] = []
    with server(args.url, str(model_dir), args.launch_arg, placement=args.placement) as served:
        dtype = served_dtype(served.url) or "float32"
        runs = run_levels(served, cases, args)
        if args.compare_inprocess:
            inprocess_baseline, rounds = compare_inprocess(served, model_dir, cases, runs, args)
    report: dict[str, Any] = {
        "model": args.model_id or f"random {args.random_model}",
        "dtype": dtype,
        "url": args.url or "launched",
        "workload": workload,
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
    if args.compare_prefix_caching:
        report["prefix_caching"] = compare_prefix_caching(model_dir, cases, args, runs)
    if args.ceiling:
        with args.placement.compute():
            report["ceiling"] = run_ceiling(model_dir)
    if args.plot is not None:
        plot(report, args.plot)
    print(json.dumps(report) if args.json else format_table(report))
    return 0 if all(level["num_failed"] == 0 for level in report["levels"]) else 1
