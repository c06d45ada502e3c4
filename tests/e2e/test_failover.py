"""Nothing lost: a worker group or a scheduler dies (kill -9) while 16 greedy streams run, and
every stream still completes, token for token as transformers generates it, with one unbroken
run of indexes (the gateway drops replayed indexes)."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from services.worker.service import ORPHANED_AFTER_S
from tests.e2e.test_pipeline import prompt_text
from tests.support.cluster import Cluster
from tests.support.reference import greedy_ids

pytestmark = pytest.mark.integration
CASES = [(prompt_text(i, 3 + (i * 5) % 20), 150 + (i * 37) % 200) for i in range(16)]


@pytest.fixture
def cluster(own_cluster):
    # each group holds at most 8 of the 16 streams: a scheduler pulls all it has room for, so
    # with room for all of them one group could take every stream and leave g0 idle
    return own_cluster("--claim-timeout", "2", "--max-batch-size", "8", num_gateways=2)


async def stream(
    client: httpx.AsyncClient, url: str, prompt: str, n: int, adapter_id: str | None = None
) -> list[dict]:
    events = []
    parameters = {"max_new_tokens": n, "details": True, "adapter_id": adapter_id}
    async with client.stream(
        "POST", f"{url}/generate_stream", json={"inputs": prompt, "parameters": parameters}
    ) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


def run_while_killing(
    cluster: Cluster,
    victim: str,
    cases: list[tuple[str, int, str | None]] | None = None,
    busy: int = 2,
) -> list[list[dict]]:
    """Stream `cases` (prompt, max_new_tokens, adapter_id; default: CASES on the base model)
    over the gateways in turn, SIGKILL `victim` once group g0 runs `busy` of them."""
    cases = cases or [(prompt, n, None) for prompt, n in CASES]

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [
                asyncio.ensure_future(stream(client, cluster.gateway_urls[i % 2], *case))
                for i, case in enumerate(cases)
            ]
            for _ in range(3000):  # kill once group g0 is busy (30 s at most)
                stats = cluster.stats().get("g0")
                if stats is not None and stats.num_running >= busy:
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail(f"group g0 never ran {busy} requests: {cluster.stats()}")
            cluster.processes[victim].send_signal(signal.SIGKILL)
            return await asyncio.gather(*tasks)

    return asyncio.run(scenario())


def assert_complete_and_exact(results: list[list[dict]], model) -> None:
    for (prompt, n), events in zip(CASES, results, strict=True):
        assert "error" not in events[-1], events[-1]
        assert [e["index"] for e in events] == list(range(1, len(events) + 1)), prompt
        assert [e["token"]["id"] for e in events] == greedy_ids(model, prompt, n, [2]), prompt
        assert events[-1]["generated_text"] is not None


def test_kill_a_worker_group_mid_run(cluster, tiny_llama):
    results = run_while_killing(cluster, "worker-g0")
    assert_complete_and_exact(results, tiny_llama)
    assert "handing its requests back" in cluster.logs["scheduler-g0"].read_text()
    cluster.wait_idle(groups=["g1"])  # g0's scheduler lost its worker: its stats stay


def test_kill_a_scheduler_mid_run(cluster, tiny_llama):
    results = run_while_killing(cluster, "scheduler-g0")
    assert_complete_and_exact(results, tiny_llama)
    assert "claimed" in cluster.logs["scheduler-g1"].read_text()
    # g0's worker still holds what its scheduler ran: stopped, it waits for plans no more
    # than ORPHANED_AFTER_S, not the 30 s of --shutdown-grace
    worker = cluster.processes["worker-g0"]
    worker.terminate()
    assert worker.wait(timeout=ORPHANED_AFTER_S + 5) == 0
    assert "while stopping: no scheduler drives" in cluster.logs["worker-g0"].read_text()
