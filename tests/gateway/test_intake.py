"""The gateway's intake on a real Redis: the queue limit, and --redis-wait-replicas (WAIT in
the XADD's pipeline) on a Redis with no replica, where it times out short and the request
still goes in, counted."""

from __future__ import annotations

import redis.asyncio as aioredis

from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline.intake import WAIT_TIMEOUT_MS, Intake


def sample(metrics: GatewayMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


async def test_wait_for_replicas_times_out_short_and_counts(redis_url, namespace):
    client = aioredis.from_url(redis_url)
    metrics = GatewayMetrics(max_input_tokens=16, max_total_tokens=32)
    lanes = [f"{namespace}:a", f"{namespace}:b"]
    plain = Intake(client, metrics, max_queue_length=2)
    assert await plain.add([*lanes, lanes[0]], b"x")
    assert sample(metrics, "textgen_intake_wait_seconds_count") == 0  # no WAIT asked
    waiting = Intake(client, metrics, max_queue_length=2, wait_replicas=1)
    assert await waiting.add([*lanes, lanes[1]], b"y")  # no replica: WAIT answers 0
    assert sample(metrics, "textgen_intake_wait_seconds_count") == 1
    assert sample(metrics, "textgen_intake_wait_seconds_sum") >= WAIT_TIMEOUT_MS / 1000 * 0.9
    assert metrics.num_unreplicated == 1
    assert "textgen_intake_unreplicated_requests 1" in metrics.render().decode()
    assert await client.xlen(lanes[1]) == 1  # it went in all the same
    assert await waiting.add([*lanes, lanes[1]], b"z")
    assert await waiting.add([*lanes, lanes[1]], b"w") is None  # 3 waiting > 2: full
    await client.aclose()
