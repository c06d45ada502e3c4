"""`textgen bench` end to end against a live stories260k server it launches itself; the
optional parts (plot, in-process engine) degrade with a clear message."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from services.bench.plot import MISSING, can_plot
from services.launcher.cli import main
from shared.host import describe_cpu

REPO = Path(__file__).resolve().parents[2]


def bench_json(model: Path, *flags: str) -> dict:
    """`textgen bench --json` on `model` with short prompts and `flags`: its report."""
    argv = [sys.executable, "-m", "services.launcher.cli", "bench", "--model-id", str(model)]
    argv += ["--input-len-range", "16:32", "--no-progress", "--json", *flags]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.integration
def test_smoke_run_json(stories_model):
    argv = [sys.executable, "-m", "services.launcher.cli", "bench", "--model-id"]
    argv += [str(stories_model), "--num-requests", "8", "--concurrency", "1,4", "--json"]
    argv += ["--input-len-range", "16:64", "--output-len-range", "8:32"]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "c=4 [" in result.stderr  # the progress bar
    report = json.loads(result.stdout)  # stdout is the report alone
    assert report["host"] == asdict(describe_cpu())  # the machine the numbers came from
    assert [(level["mode"], level["value"]) for level in report["levels"]] == [
        ("concurrency", 1),
        ("concurrency", 4),
    ]
    for level in report["levels"]:
        assert level["num_requests"] == level["num_completed"] == 8
        assert level["num_failed"] == 0
        assert level["output_tokens"] > 0
        assert level["output_token_throughput"] > 0 and level["request_throughput"] > 0
        assert level["ttft"]["count"] == level["e2e"]["count"] == 8
        assert level["itl"]["count"] == level["output_tokens"] - 8
        # every part of the launched system is measured, and the worker did the computing
        assert {"worker", "scheduler", "gateway", "redis", "bench"} <= set(level["cpu_pct"])
        assert level["cpu_pct"]["worker"] > 0
        for name in ("ttft", "itl", "e2e"):
            summary = level[name]
            assert 0 <= summary["p50_ms"] <= summary["p90_ms"] <= summary["p99_ms"]
            assert summary["p99_ms"] <= summary["max_ms"]
        assert level["ttft"]["p50_ms"] <= level["e2e"]["p50_ms"]


@pytest.mark.integration
def test_rounds_pair_the_server_with_the_inprocess_engine(stories_model):
    argv = [sys.executable, "-m", "services.launcher.cli", "bench", "--model-id"]
    argv += [str(stories_model), "--num-requests", "6", "--concurrency", "3", "--json"]
    argv += ["--input-len-range", "16:48", "--output-len-range", "8:16", "--seed", "5"]
    argv += ["--compare-inprocess", "--rounds", "3"]
    argv += ["--launch-arg=--dtype", "--launch-arg=bfloat16"]  # not the checkpoint's float32
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "round 2 c=3 [" in result.stderr  # each round's server level has its progress bar
    report = json.loads(result.stdout)
    baseline = report["baselines"]["inprocess"]
    assert report["dtype"] == baseline["dtype"] == "bfloat16"  # the engine runs as the server
    # the in-process run happened beside the idle launched server, whose CPU is reported
    assert {"worker", "scheduler", "gateway", "redis"} <= set(baseline["server_idle_cpu_pct"])
    rounds = report["rounds"]["rounds"]
    assert [(r["round"], r["seed"], r["first"]) for r in rounds] == [
        (0, 5, "server"),
        (1, 6, "inprocess"),
        (2, 7, "server"),
    ]
    # round 0 is the report's level and baseline; every round measured both sides
    assert rounds[0]["server_tokens_per_s"] == report["levels"][0]["output_token_throughput"]
    assert rounds[0]["inprocess_tokens_per_s"] == baseline["tokens_per_s"]
    for r in rounds:
        assert r["server_failed"] == 0
        assert r["server_tokens_per_s"] > 0 and r["inprocess_tokens_per_s"] > 0
        assert r["ratio"] == pytest.approx(
            r["server_tokens_per_s"] / r["inprocess_tokens_per_s"], abs=1e-3
        )
    ratios = sorted(r["ratio"] for r in rounds)
    assert report["rounds"]["median"]["ratio"] == ratios[1]


@pytest.mark.integration
def test_fake_step_ms_simulates_the_server_and_the_inprocess_engine(stories_model):
    report = bench_json(
        stories_model,
        *["--num-requests", "4", "--concurrency", "2", "--output-len-range", "6:6"],
        *["--fake-step-ms", "25", "--compare-inprocess"],
    )
    level = report["levels"][0]
    assert level["num_completed"] == 4 and level["num_failed"] == 0
    baseline = report["baselines"]["inprocess"]
    assert baseline["fake_step_ms"] == 25
    # the engine ran the simulated backend, not the model: a request's 6 tokens come from 6
    # forward passes of 25 ms each, and the closed loop at 2 runs the 4 requests in two waves
    # (the real stories260k takes about a millisecond a step)
    assert baseline["generated_tokens"] == 24
    assert baseline["wall_s"] >= 0.9 * 2 * 6 * 0.025
    # the launched worker ran simulated steps too: a first token comes out of a step of 25 ms
    # (the real stories260k computes one in about a millisecond)
    assert level["ttft"]["p50_ms"] >= 25


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--url", "http://127.0.0.1:1"], "drop --url"),
        (["--compare-transformers"], "drop --compare-transformers"),
        (["--fake-step-ms=-1"], "must be >= 0"),
    ],
)
def test_fake_step_ms_refuses_what_it_cannot_simulate(capsys, stories_model, flags, message):
    argv = ["bench", "--model-id", str(stories_model), "--no-progress"]
    argv += ["--fake-step-ms", "5", *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(capsys, stories_model, tmp_path):
    if can_plot():
        pytest.skip("matplotlib is installed")
    argv = ["bench", "--model-id", str(stories_model), "--plot", str(tmp_path / "out.png")]
    assert main(argv) == 2
    assert MISSING in capsys.readouterr().err


@pytest.mark.integration
def test_constrained_share_reports_ratios_and_compile_time(stories_model):
    flags = ["--num-requests", "8", "--concurrency", "4", "--output-len-range", "40:40"]
    report = bench_json(stories_model, *flags, "--constrained-share", "0.5")["constrained"]
    assert report["share"] == 0.5 and report["compile_ms"] > 0
    (level,) = report["levels"]
    assert level["concurrency"] == 4 and level["num_failed"] == 0
    assert level["plain_tok_s"] > 0 and level["mixed_tok_s"] > 0
    assert level["throughput_ratio"] == round(level["mixed_tok_s"] / level["plain_tok_s"], 3)
    assert level["itl_p50_constrained_ms"] > 0 and level["itl_p50_unconstrained_ms"] > 0


def test_constrained_share_marks_an_even_spread():
    from services.bench.constrained import constrained_indexes, with_constraints
    from services.bench.workload import Case

    assert constrained_indexes(8, 0.5) == {0, 2, 4, 6}
    assert constrained_indexes(10, 0.0) == set() and len(constrained_indexes(10, 1.0)) == 10
    cases = with_constraints([Case("x", 4)] * 4, 0.25)
    assert [case.grammar is not None for case in cases] == [True, False, False, False]
    assert main(["bench", "--model-id", "x", "--constrained-share", "2"]) == 2


@pytest.mark.integration
def test_api_openai_drives_the_completions_route(stories_model):
    """--api openai: streamed /v1/completions with ignore_eos, so every request runs to its
    max_tokens and the usage chunk's count is what the report adds up."""
    flags = ["--num-requests", "6", "--concurrency", "3", "--output-len-range", "24:24"]
    (level,) = bench_json(stories_model, *flags, "--api", "openai")["levels"]
    assert level["num_completed"] == 6 and level["output_tokens"] == 6 * 24
    assert level["ttft"]["count"] == 6 and level["itl"]["count"] > 0


@pytest.mark.integration
def test_lora_spreads_requests_over_adapters_and_compares(tiny_llama, monkeypatch, tmp_path):
    """--lora 2 --compare-lora: every request of the mixed level names an adapter the launched
    server registered; the base and one-adapter-per-step levels run too, with ratios."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flags = ["--num-requests", "6", "--concurrency", "3", "--output-len-range", "8:8"]
    report = bench_json(tiny_llama, *flags, "--api", "openai", "--lora", "2", "--compare-lora")
    assert "spread over 2 LoRA adapters" in report["workload"]
    (level,) = report["levels"]
    assert level["num_completed"] == 6 and level["output_tokens"] == 48
    (compared,) = report["lora"]["levels"]
    assert compared["tokens_per_s_base"] > 0 and compared["tokens_per_s_one_per_step"] > 0
    ratio = compared["tokens_per_s_mixed"] / compared["tokens_per_s_base"]
    assert compared["mixed_over_base"] == pytest.approx(ratio, abs=1e-3)
    assert sorted(p.name for p in (tmp_path / "textgen" / "lora-adapters").glob("*/*")) == [
        "lora0",
        "lora1",
    ]
