"""--num-shard 2 on CPU (gloo): a tensor-parallel worker group serves the same greedy output
as one rank (and transformers), alone and batched; a dead rank takes its group down and the
other group finishes the work."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.cluster import generated_ids
from tests.support.reference import greedy_ids

pytestmark = pytest.mark.integration

PROMPTS = ["the cat sat on the mat", "once upon a time there was", "a dog", "hello world"]


def shard_pids(worker_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(worker_pid)], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def test_two_ranks_serve_the_one_rank_output(own_cluster, tiny_llama):
    cluster = own_cluster("--num-shard", "2", num_groups=1)
    url = cluster.gateway_urls[0]
    expected = [greedy_ids(tiny_llama, prompt, 16, [2]) for prompt in PROMPTS]
    assert [generated_ids(url, p, 16) for p in PROMPTS] == expected
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(lambda p: generated_ids(url, p, 16), PROMPTS)) == expected
    info = httpx.get(f"{url}/info", timeout=10).json()
    assert info["model_dtype"] == "float32"
    worker = cluster.processes[f"worker-{cluster.groups[0]}"]
    assert len(shard_pids(worker.pid)) == 1  # rank 1, a child of rank 0


def test_a_dead_rank_takes_its_group_down_and_the_other_group_serves(own_cluster, tiny_llama):
    cluster = own_cluster("--num-shard", "2", "--claim-timeout", "2", num_groups=2)
    url = cluster.gateway_urls[0]
    worker = cluster.processes[f"worker-{cluster.groups[0]}"]
    (rank_1,) = shard_pids(worker.pid)
    os.kill(rank_1, signal.SIGKILL)
    assert worker.wait(timeout=30) != 0  # rank 0 exits instead of hanging in a collective
    expected = [greedy_ids(tiny_llama, prompt, 16, [2]) for prompt in PROMPTS]
    deadline = time.monotonic() + 60
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: generated_ids(url, p, 16), PROMPTS))
    assert got == expected and time.monotonic() < deadline
