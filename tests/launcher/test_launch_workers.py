"""`textgen launch` flags that shape its workers: tensor-parallel ranks, and transformers'
modules instead of the CPU kernels; each launched for real (the helpers are
tests/launcher/test_launch.py's; several groups: its test_launch_starts_several_groups...)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from tests.launcher.test_launch import children_of, free_port_run, launch, wait_for_line
from tests.support.redis_server import free_port
from tests.support.reference import greedy_ids


def test_launch_with_cpu_kernels_disabled(tiny_llama):
    """--disable-cpu-kernels: the worker runs transformers' modules (their q/k/v and gate/up
    projections fused, services/worker/fused_layers.py) instead of the fast decoder, says so
    in /info and its metrics, and still answers as transformers' greedy generate does."""
    port, metrics_port = free_port(), free_port_run(2)  # scheduler, worker
    flags = ("--disable-cpu-kernels", "--metrics-port", str(metrics_port))
    process = launch(tiny_llama, port, *flags)
    try:
        wait_for_line(process, "textgen is ready", timeout=120)
        info = httpx.get(f"http://127.0.0.1:{port}/info", timeout=10).json()
        assert info["model_attention"] == "sdpa"
        body = {"inputs": "the cat sat", "parameters": {"max_new_tokens": 8, "details": True}}
        answer = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
        assert answer.status_code == 200
        served = [token["id"] for token in answer.json()["details"]["tokens"]]
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port + 1}/metrics", timeout=10).text
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert 'kernel="sdpa",projections="fused"} 1.0' in metrics
    assert served == greedy_ids(tiny_llama, "the cat sat", 8, [2])


def test_launch_with_tensor_parallel_ranks(tiny_llama):
    """--num-shard 2: one worker group of two ranks (gloo on the CPU) answers as transformers'
    greedy generate does, and each rank computes on its share of the CPUs (OMP_NUM_THREADS),
    not on a pool of every CPU per rank."""
    port, metrics_port = free_port(), free_port_run(2)  # scheduler, worker (rank 0)
    process = launch(tiny_llama, port, "--num-shard", "2", "--metrics-port", str(metrics_port))
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    try:
        wait_for_line(process, "textgen is ready", timeout=120)
        body = {"inputs": "the cat sat", "parameters": {"max_new_tokens": 8, "details": True}}
        answer = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
        assert answer.status_code == 200
        served = [token["id"] for token in answer.json()["details"]["tokens"]]
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port + 1}/metrics", timeout=10).text
        worker = next(
            pid
            for pid in children_of(process.pid)
            if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        )
        (rank_1,) = children_of(worker)
        environ = Path(f"/proc/{rank_1}/environ").read_bytes().split(b"\0")
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert f"textgen_worker_torch_threads {threads}.0" in metrics
    assert f"OMP_NUM_THREADS={threads}".encode() in environ
    assert served == greedy_ids(tiny_llama, "the cat sat", 8, [2])
