"""`textgen bench`: tokens/s of the server against transformers' generate, in one run.

Sends a mixed workload of concurrent /generate requests (greedy) to a running server (--url,
else a `textgen launch` it starts itself on a free port), then runs transformers' generate on
the same prompts, sequentially and as one padded batch, and prints the ratios. Greedy outputs of
the server and of the sequential reference are compared token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import httpx

from services.bench.http_load import run_load
from services.bench.reference import run_batched, run_sequential
from services.bench.workload import mixed_workload
from shared.model_files import eos_token_ids, resolve_model_dir
from shared.net import free_port


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-id", required=True, help="model folder or hub id")
    parser.add_argument("--url", help="a running server; default: launch one")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--min-new-tokens", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _launch(model_id: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.launcher.cli",
            "launch",
            "--model-id",
            model_id,
            "--port",
            str(port),
            "--log-level",
            "WARNING",
        ],
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit("textgen launch exited before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("textgen launch was not ready in 600 s")


def run(args: argparse.Namespace) -> int:
    cases = mixed_workload(args.num_requests, args.min_new_tokens, args.max_new_tokens)
    folder = resolve_model_dir(args.model_id)
    eos = eos_token_ids(folder)
    process = None
    url = args.url
    if url is None:
        process, url = _launch(str(folder))
    try:
        asyncio.run(run_load(url, cases[:2]))  # warm-up
        server = asyncio.run(run_load(url, cases))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    sequential = run_sequential(str(folder), cases, eos)
    batched = run_batched(str(folder), cases, eos)
    matches = sum(a == b for a, b in zip(server.token_ids, sequential.token_ids))
    report = {
        "model": args.model_id,
        "num_requests": len(cases),
        "server_tokens_per_s": round(server.tokens_per_s, 1),
        "server_generated_tokens": server.num_generated_tokens,
        "server_wall_s": round(server.wall_s, 3),
        "server_p50_latency_s": round(sorted(server.latencies_s)[len(cases) // 2], 3),
        "hf_sequential_tokens_per_s": round(sequential.tokens_per_s, 1),
        "hf_batched_tokens_per_s": round(batched.tokens_per_s, 1),
        "ratio_vs_hf_sequential": round(server.tokens_per_s / sequential.tokens_per_s, 2),
        "ratio_vs_hf_batched": round(server.tokens_per_s / batched.tokens_per_s, 2),
        "greedy_outputs_equal_to_hf": f"{matches}/{len(cases)}",
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:32s} {value}")
    return 0
