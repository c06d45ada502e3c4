"""`textgen bench`'s flags (services/bench/main.py runs them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from services.bench.apis import APIS
from services.bench.random_model import SHAPES
from services.bench.workload import parse_range

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
        "--api",
        choices=APIS,
        default="tgi",
        help="tgi: /generate_stream; openai: streamed /v1/completions with ignore_eos and the "
        "usage chunk, against any OpenAI-compatible server (vLLM, textgen, ...)",
    )
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
        "--constrained-share",
        type=float,
        default=0.0,
        metavar="F",
        help="run each --concurrency level four times on the same prompts: plain, twice with "
        "a share F (0-1) of the requests under a JSON schema, plain; throughput and ITL "
        "ratios and a new schema's compile time",
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
        "--lora",
        type=int,
        default=0,
        metavar="N",
        help="spread the requests over N random LoRA adapters of the model (built once beside "
        "it; the launched server registers them with --max-loras N)",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=16, metavar="R", help="rank of the --lora adapters"
    )
    parser.add_argument(
        "--compare-lora",
        action="store_true",
        help="with --lora: the same levels on the base model alone, and on a second server "
        "with --max-loras 1 (one adapter per step); throughput ratios",
    )
    parser.add_argument(
        "--fake-step-ms",
        type=float,
        metavar="MS",
        help="simulated forward passes of MS ms, no weights, on the launched server "
        "(--fake-step-ms) and the in-process engine: the broker's cost around a step of a "
        "GPU's length, on any machine",
    )
    parser.add_argument(
        "--launch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to the launched server (repeat: --launch-arg=--max-batch-size "
        "--launch-arg=16)",
    )


def concurrency_levels(args: argparse.Namespace) -> list[int]:
    """The closed-loop levels to run: the flag's, or the default ones when no level is asked."""
    if args.concurrency is None and args.request_rate is None:
        return _ints(DEFAULT_CONCURRENCY)
    return args.concurrency or []
