"""The bench's comparisons on known inputs: ratios against baselines, `--rounds` pairs and
their medians, and the flags `--rounds` cannot run with."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict

import pytest

from services.bench.flags import add_bench_flags
from services.bench.main import _check_args
from services.bench.placement import Placement
from services.bench.report import (
    add_ratios,
    format_baseline,
    format_rounds,
    format_table,
    median_of_rounds,
    round_record,
)
from shared.host import CpuDescription


def level(tokens_per_s: float, itl_p50_ms: float | None, failed: int = 0) -> dict:
    return {
        "mode": "concurrency",
        "value": 32,
        "output_token_throughput": tokens_per_s,
        "itl": {"p50_ms": itl_p50_ms},
        "num_failed": failed,
    }


def engine(tokens_per_s: float, itl_p50_ms: float | None) -> dict:
    return {"available": True, "tokens_per_s": tokens_per_s, "itl": {"p50_ms": itl_p50_ms}}


def test_round_record_ratios():
    record = round_record(1, 7, "inprocess", level(300.0, 50.0), engine(320.0, 47.5))
    assert record["round"] == 1 and record["seed"] == 7 and record["first"] == "inprocess"
    assert record["ratio"] == pytest.approx(0.938)
    assert record["itl_p50_added_ms"] == pytest.approx(2.5)
    assert record["server_tokens_per_s"] == 300.0 and record["inprocess_tokens_per_s"] == 320.0


def test_round_record_without_itl_or_tokens():
    record = round_record(0, 0, "server", level(0.0, None, failed=3), engine(0.0, 4.0))
    assert record["ratio"] is None and record["itl_p50_added_ms"] is None
    assert record["server_failed"] == 3


def test_median_of_rounds_is_per_key_and_skips_missing():
    rounds = [
        round_record(0, 0, "server", level(90.0, 51.0), engine(100.0, 50.0)),  # x0.9, +1
        round_record(1, 1, "inprocess", level(110.0, 47.0), engine(100.0, 50.0)),  # x1.1, -3
        round_record(2, 2, "server", level(100.0, None), engine(100.0, 50.0)),  # x1.0, -
        round_record(3, 3, "inprocess", level(80.0, 52.0), engine(100.0, 50.0)),  # x0.8, +2
    ]
    median = median_of_rounds(rounds)
    assert median["ratio"] == pytest.approx(0.95)  # mean of the middle two of four
    assert median["itl_p50_added_ms"] == pytest.approx(1.0)  # middle of -3, +1, +2
    assert median_of_rounds([]) == {"ratio": None, "itl_p50_added_ms": None}


def test_format_rounds_signs_and_median_line():
    rounds = [
        round_record(0, 0, "server", level(90.0, 49.0), engine(100.0, 50.0)),
        round_record(1, 1, "inprocess", level(110.0, 52.0), engine(100.0, 50.0)),
    ]
    lines = format_rounds({"rounds": rounds, "median": median_of_rounds(rounds)})
    assert lines[0].startswith("round 0 (seed 0, server first): server 90.0 tok/s")
    assert "(-1.0)" in lines[0] and "(+2.0)" in lines[1]
    assert lines[-1] == "median of 2 rounds: server/inprocess x1.0, itl p50 +0.5 ms"
    assert format_rounds(None) == []


def test_add_ratios_and_baseline_line():
    report = {"levels": [level(300.0, 48.0)], "baselines": {"inprocess": engine(250.0, 50.0)}}
    report["baselines"]["inprocess"]["server_idle_cpu_pct"] = {"gateway": 0.1}
    add_ratios(report)
    assert report["levels"][0]["ratio_vs"] == {"inprocess": 1.2}
    assert report["levels"][0]["itl_p50_added_ms"] == {"inprocess": -2.0}
    line = format_baseline("inprocess", report["baselines"]["inprocess"], report["levels"])
    assert "c=32 x1.20" in line and "(c=32 -2.0)" in line and "gateway 0.1" in line


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_flags(parser)
    return parser.parse_args(["--model-id", "m", *argv])


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--rounds", "3", "--concurrency", "32"], "add --compare-inprocess"),
        (["--rounds", "3", "--compare-inprocess"], "exactly one --concurrency level"),
        (["--rounds", "3", "--compare-inprocess", "--concurrency", "4,8"], "exactly one"),
        (
            ["--rounds", "3", "--compare-inprocess", "--concurrency", "4", "--request-rate", "2"],
            "no --request-rate",
        ),
        (
            ["--rounds", "2", "--compare-inprocess", "--concurrency", "4", "--dataset", "d"],
            "drop --dataset",
        ),
    ],
)
def test_rounds_flag_problems(argv, problem):
    assert problem in _check_args(parse(argv))


def test_rounds_flags_accepted():
    assert (
        _check_args(parse(["--rounds", "5", "--compare-inprocess", "--concurrency", "32"])) is None
    )
    assert _check_args(parse(["--compare-inprocess", "--concurrency", "1,4"])) is None


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--worker-cpus", "0", "--url", "http://x"], "drop --url"),
        (["--worker-cpus", "4096"], "not available here"),
        (["--worker-cpus", "x"], "bad CPU list"),
    ],
)
def test_worker_cpus_flag_problems(argv, problem):
    assert problem in _check_args(parse(argv))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to split")
def test_the_bench_follows_the_split():
    """Compute on the workers' CPUs with one torch thread each; the client on the others;
    both undone after; the launched server gets the same flag."""
    import torch

    available = os.sched_getaffinity(0)
    worker_cpu = max(available)
    assert _check_args(parse(["--worker-cpus", str(worker_cpu)])) is None
    placement = Placement(str(worker_cpu))
    assert placement.launch_args() == ["--worker-cpus", str(worker_cpu)]
    threads = torch.get_num_threads()
    with placement.compute():
        assert os.sched_getaffinity(0) == {worker_cpu}
        assert torch.get_num_threads() == 1
    with placement.client():
        assert os.sched_getaffinity(0) == available - {worker_cpu}
    assert os.sched_getaffinity(0) == available
    assert torch.get_num_threads() == threads
    unsplit = Placement()
    assert unsplit.launch_args() == []
    with unsplit.compute(), unsplit.client():
        assert os.sched_getaffinity(0) == available


def test_the_table_names_the_bench_host():
    cpu = CpuDescription("Intel(R) Xeon(R) Processor", "6", "207", 2, ["avx2"], ["amx_tile"])
    summary = {"p50_ms": 1.0, "p90_ms": 2.0, "p99_ms": 3.0}
    report = {
        "model": "m",
        "workload": "w",
        "host": asdict(cpu),
        "levels": [
            level(100.0, 1.0)
            | {"num_completed": 1, "num_requests": 1, "request_throughput": 1.0, "errors": []}
            | {"ttft": summary, "itl": summary, "e2e": summary}
        ],
    }
    lines = format_table(report).splitlines()
    assert lines[1] == (
        "bench host Intel(R) Xeon(R) Processor (family 6 model 207), 2 CPUs: avx2; no amx_tile"
    )
    del report["host"]  # a report of an older textgen
    assert not any(line.startswith("bench host") for line in format_table(report).splitlines())
