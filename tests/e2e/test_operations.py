"""Operations: every service's /metrics moves as the work says, and the probes answer."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
import torch

from services.worker import kernels
from tests.e2e.test_pipeline import prompt_text

pytestmark = pytest.mark.integration


def scrape(base: str) -> dict[str, float]:
    """Sample name (with its labels, as exposed) -> value; names are taken verbatim, since
    TGI's counters have no `_total` suffix and parsers that add one would hide that."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def total(cluster, service: str, name: str) -> float:
    return sum(
        scrape(url).get(name, 0.0)
        for key, url in cluster.ops_urls.items()
        if key.startswith(service)
    )


def test_probes_of_scheduler_and_worker(tiny_cluster):
    for base in tiny_cluster.ops_urls.values():
        assert httpx.get(f"{base}/live").status_code == 200
        assert httpx.get(f"{base}/ready").status_code == 200
        assert httpx.get(f"{base}/nope").status_code == 404


def test_sigusr1_dumps_a_gateways_stacks_and_it_goes_on(tiny_cluster):
    """`kill -USR1` on a gateway, as the README offers for a stuck service: its threads' and
    its loop's tasks' stacks in its log, and it goes on serving (under uvicorn.run the signal
    killed it)."""
    process, log = tiny_cluster.processes["gateway-0"], tiny_cluster.logs["gateway-0"]
    size = log.stat().st_size
    process.send_signal(signal.SIGUSR1)
    deadline, dump = time.monotonic() + 30, ""
    while "Stack for <Task" not in dump and time.monotonic() < deadline:
        time.sleep(0.1)
        with log.open("rb") as text:
            text.seek(size)
            dump = text.read().decode(errors="replace")
    assert process.poll() is None, tiny_cluster.log_tails()
    assert "Thread " in dump and "'MainThread'" in dump, dump
    assert "Stack for <Task" in dump and "uvicorn" in dump, dump
    response = httpx.post(
        f"{tiny_cluster.gateway_urls[0]}/generate",
        json={"inputs": prompt_text(0, 5), "parameters": {"max_new_tokens": 3}},
        timeout=60,
    )
    assert response.status_code == 200 and process.poll() is None


def test_metrics_of_all_three_services_follow_a_run(tiny_cluster):
    gateway = tiny_cluster.gateway_urls[0]
    tiny_cluster.wait_idle()
    before_gateway = scrape(gateway)
    before_tokens = total(tiny_cluster, "worker", "textgen_worker_generated_tokens_total")
    before_pulled = total(tiny_cluster, "scheduler", "textgen_scheduler_pulled_requests_total")
    before_forwards = total(tiny_cluster, "worker", "textgen_worker_forward_duration_seconds_count")
    before_publishes = total(
        tiny_cluster, "worker", "textgen_worker_publish_duration_seconds_count"
    )
    before_gaps = total(tiny_cluster, "worker", "textgen_worker_step_gap_seconds_count")
    before_late = total(tiny_cluster, "worker", "textgen_worker_plan_late_seconds_count")

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = [
                asyncio.ensure_future(
                    client.post(
                        f"{gateway}/generate",
                        json={
                            "inputs": prompt_text(i, 5 + i),
                            "parameters": {"max_new_tokens": 300, "details": True},
                        },
                    )
                )
                for i in range(6)
            ]
            seen_blocks = seen_running = 0.0
            while not all(t.done() for t in tasks):
                await asyncio.sleep(0.05)
                blocks = await asyncio.to_thread(
                    total, tiny_cluster, "scheduler", "textgen_scheduler_kv_blocks_used"
                )
                running = await asyncio.to_thread(
                    total, tiny_cluster, "scheduler", "textgen_scheduler_running"
                )
                seen_blocks, seen_running = max(seen_blocks, blocks), max(seen_running, running)
            bodies = [t.result().json() for t in tasks]
            return seen_blocks, seen_running, bodies

    blocks_during, running_during, bodies = asyncio.run(run())
    assert blocks_during > 0 and running_during > 0
    stats = tiny_cluster.wait_idle()
    generated = sum(b["details"]["generated_tokens"] for b in bodies)
    after_gateway = scrape(gateway)
    assert after_gateway["tgi_request_count"] - before_gateway["tgi_request_count"] == 6
    assert after_gateway["tgi_request_success"] - before_gateway["tgi_request_success"] == 6
    assert after_gateway["tgi_queue_size"] == 0
    assert after_gateway["tgi_batch_current_size"] == 0
    assert (
        after_gateway["tgi_request_generated_tokens_sum"]
        - before_gateway["tgi_request_generated_tokens_sum"]
    ) == generated
    worker_tokens = total(tiny_cluster, "worker", "textgen_worker_generated_tokens_total")
    assert worker_tokens - before_tokens == generated
    assert total(tiny_cluster, "scheduler", "textgen_scheduler_pulled_requests_total") == (
        before_pulled + 6
    )
    forwards = total(tiny_cluster, "worker", "textgen_worker_forward_duration_seconds_count")
    assert forwards > before_forwards
    # every step's events went out (after the next step started, or before waiting for one)
    publishes = total(tiny_cluster, "worker", "textgen_worker_publish_duration_seconds_count")
    assert publishes - before_publishes == forwards - before_forwards
    # a CPU pass is not queued on a device: every output went out between two steps
    assert total(tiny_cluster, "worker", "textgen_worker_overlapped_sends_total") == 0
    # plans reach the torch thread while the step before them computes (back to back)
    gaps = total(tiny_cluster, "worker", "textgen_worker_step_gap_seconds_count") - before_gaps
    assert 0 < gaps < forwards - before_forwards
    # ...or came after it, while the worker held requests (never both)
    late = total(tiny_cluster, "worker", "textgen_worker_plan_late_seconds_count") - before_late
    assert late >= 0 and gaps + late <= forwards - before_forwards
    # the tiny Llama runs on the fast CPU decoder in both groups
    level, matmul = kernels.capability(), kernels.load().matmul
    # bfloat16 matmuls: the AVX512-BF16 kernel's faster multiply (each worker times both), else
    # what this level has
    # what a worker's bfloat16 prompt chunks attend with follows: dot products or widened
    bf16 = [(matmul.kind(torch.bfloat16), "widen")]
    if matmul.has_bf16_dot_products:
        bf16 = [("avx512bf16", "dot"), ("avx512widen", "widen")]
    if matmul.has_amx:  # and chunks of 64 queries or more on the tiles
        bf16 = [("amx", "amx")]
    infos = [
        f'textgen_worker_attention_info{{bf16_attention="{attention}",bf16_matmul="{name}",'
        f'instruction_set="{level}",kernel="cpu-kernels",projections="fused"}}'
        for name, attention in bf16
    ]
    assert sum(total(tiny_cluster, "worker", info) for info in infos) == 2
    # both CPU workers keep the pages their step tensors free (glibc)
    assert total(tiny_cluster, "worker", "textgen_worker_malloc_kept") == 2
    assert total(tiny_cluster, "scheduler", "textgen_scheduler_kv_blocks_used") == 0
    assert total(tiny_cluster, "scheduler", "textgen_scheduler_running") == 0
    assert total(tiny_cluster, "scheduler", "textgen_scheduler_kv_blocks") == sum(
        s.num_blocks for s in stats.values()
    )
    assert len(bodies) == 6
