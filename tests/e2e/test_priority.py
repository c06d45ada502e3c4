"""Priority lanes: with the group full, a high-priority request overtakes the queue, a
low-priority one waits for the rest, and each lane is first come, first served."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.conftest import CLUSTER_ARGS
from tests.support.cluster import Cluster

pytestmark = pytest.mark.integration


def test_lanes_order_the_queue(redis_url, tiny_llama, namespace):
    cluster = Cluster(
        redis_url, namespace, tiny_llama, args=[*CLUSTER_ARGS, "--max-batch-size", "1"]
    )
    try:
        url = cluster.start().gateway_urls[0]
        finished: list[str] = []

        async def send(client, name: str, priority: int | None, max_new_tokens: int):
            parameters = {"max_new_tokens": max_new_tokens}
            if priority is not None:
                parameters["priority"] = priority
            response = await client.post(
                f"{url}/generate", json={"inputs": "the cat", "parameters": parameters}
            )
            assert response.status_code == 200, response.text
            finished.append(name)

        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                blocker = asyncio.ensure_future(send(client, "blocker", None, 400))
                while not cluster.stats().get("g0") or cluster.stats()["g0"].num_running == 0:
                    await asyncio.sleep(0.01)
                queued = []
                for name, priority in (
                    ("normal-1", None),
                    ("low", -1),
                    ("normal-2", 0),
                    ("high", 5),
                ):
                    queued.append(asyncio.ensure_future(send(client, name, priority, 3)))
                    await asyncio.sleep(0.05)  # arrival order
                await asyncio.gather(blocker, *queued)

        started = time.monotonic()
        asyncio.run(scenario())
    finally:
        cluster.stop()
    assert finished == ["blocker", "high", "normal-1", "normal-2", "low"], finished
    assert time.monotonic() - started < 60
