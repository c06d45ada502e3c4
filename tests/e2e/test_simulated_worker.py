"""The simulated worker (--fake-step-ms): no model, fixed step time, real control plane."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.conftest import CLUSTER_ARGS
from tests.e2e.test_operations import scrape
from tests.support.cluster import Cluster

pytestmark = pytest.mark.integration


def test_fake_groups_serve_through_the_real_control_plane(redis_url, tiny_llama, namespace):
    cluster = Cluster(
        redis_url, namespace, tiny_llama, num_groups=2, args=[*CLUSTER_ARGS, "--fake-step-ms", "5"]
    )
    try:
        url = cluster.start().gateway_urls[0]

        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(
                    *(
                        client.post(
                            f"{url}/generate",
                            json={
                                "inputs": "the cat",
                                "parameters": {"max_new_tokens": 10 + i, "details": True},
                            },
                        )
                        for i in range(12)
                    )
                )

        responses = asyncio.run(run())
        stats = cluster.wait_idle()
        # as on a GPU, the worker sent most steps' outputs while the next step's pass ran
        workers = [url for name, url in cluster.ops_urls.items() if name.startswith("worker")]
        samples = [scrape(url) for url in workers]
        counts = [sample["textgen_worker_overlapped_sends_total"] for sample in samples]
        steps = [sample["textgen_worker_publish_duration_seconds_count"] for sample in samples]
    finally:
        cluster.stop()
    for i, response in enumerate(responses):
        details = response.json()["details"]
        assert details["finish_reason"] == "length"
        assert details["generated_tokens"] == 10 + i
        assert all(t["id"] != 2 for t in details["tokens"])  # never EOS
    assert all(0 < n < total for n, total in zip(counts, steps, strict=True)), (counts, steps)
    assert all(s.num_finished > 0 for s in stats.values())
    assert all(s.num_free_blocks == s.num_blocks for s in stats.values())
