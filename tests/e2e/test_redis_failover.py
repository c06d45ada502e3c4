"""The Redis primary goes under load and Sentinel promotes a replica (../shared/reference/
redis-ha.md): kill -9 (T1), kill -9 after the replicas lagged half a second (T2: the new
primary lacks the newest writes), and a graceful SENTINEL FAILOVER (T6: the old primary stays
up and writable until Sentinel demotes it; the services leave it as soon as the sentinels name
the new master, shared/master_watch.py). Every service follows
the master through --redis-sentinels, and 32 streams in flight complete token for token as
without the fault, each index once, no 5xx, and the stall stays bounded (the gateway
re-submits what the switch lost: services/gateway/pipeline/resume.py). Intake waits for one
replica (--redis-wait-replicas 1)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time

import httpx
import pytest

from tests.e2e.conftest import CLUSTER_ARGS
from tests.support.cluster import Cluster
from tests.support.redis_ha import RedisHA

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]
NUM_STREAMS = 32
PROMPTS = ["Once upon a time", "The cat sat", "A tiny robot", "In the morning"]
NEW_TOKENS = 300
STALL_ALLOWANCE_S = 2.0  # a client's longest pause: at most the failover and this


# T6 leaves the old primary writable, and T2 kills it only after the replicas lagged 0.5 s, so
# the streams only span the fault if they outlast that: the tiny model's 300 tokens took less
# on a fast host (steps of ~2 ms), and the streams ended before the fault (T6: on the old
# primary, before any service saw the switch). There the worker is simulated at this many ms a
# step (300 tokens: ~3 s); T1 kills the primary at once and keeps the model.
SLOW_FAULTS = ("lagging-replicas-then-kill-9", "sentinel-failover")
SIMULATED_STEP_MS = "10"
FOLLOW_S = 5.0  # how long the gateway may take to count the switch after the sentinels name it


@pytest.fixture
def cluster(redis_ha, tiny_llama, namespace, request):
    flags = [*CLUSTER_ARGS, "--max-batch-total-tokens", "20000"]
    flags += ["--redis-sentinels", redis_ha.sentinels, "--redis-wait-replicas", "1"]
    if request.node.callspec.params.get("fault") in SLOW_FAULTS:
        flags += ["--fake-step-ms", SIMULATED_STEP_MS]
    primary = f"redis://127.0.0.1:{redis_ha.data_ports[0]}"  # the test's own readiness checks
    cluster = Cluster(primary, namespace, tiny_llama, args=flags)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


async def stream(
    http: httpx.AsyncClient, prompt: str, started: asyncio.Event
) -> tuple[int, list[dict], list[float]]:
    """The status, every SSE event and each one's arrival (monotonic)."""
    events: list[dict] = []
    times: list[float] = []
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS}}
    async with http.stream("POST", "/generate_stream", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:") :]))
                times.append(time.monotonic())
                if len(events) == 5:
                    started.set()
    started.set()
    return response.status_code, events, times


FAULTS = {
    "kill-9": RedisHA.kill_primary,  # T1
    "lagging-replicas-then-kill-9": RedisHA.lag_replicas_then_kill_primary,  # T2
    "sentinel-failover": RedisHA.failover,  # T6: graceful
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_streams_survive_losing_the_redis_primary(cluster, redis_ha, fault):
    url = cluster.gateway_urls[0]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as http:
        undisturbed = await asyncio.gather(*(stream(http, p, asyncio.Event()) for p in PROMPTS))
        expected = {p: [e["token"]["id"] for e in r[1]] for p, r in zip(PROMPTS, undisturbed)}
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(NUM_STREAMS)]
        started = [asyncio.Event() for _ in prompts]
        streams = [
            asyncio.create_task(stream(http, p, s)) for p, s in zip(prompts, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
        old = FAULTS[fault](redis_ha)
        failover_s = await asyncio.to_thread(redis_ha.wait_failover, old)
        try:
            results = await asyncio.wait_for(asyncio.gather(*streams), 60)
        except TimeoutError:
            hung = f"streams hung\n{cluster.log_tails(4000)}\n{cluster.stacks()}"
            raise AssertionError(hung) from None
        pauses = [max(b - a for a, b in zip(r[2], r[2][1:])) for r in results]
        print(f"failover {failover_s:.1f} s, longest pause {max(pauses):.1f} s")
        for prompt, (status, events, _), pause in zip(prompts, results, pauses, strict=True):
            assert status == 200
            assert "error" not in events[-1], events[-1]
            assert [e["index"] for e in events] == list(range(1, len(events) + 1))
            assert [e["token"]["id"] for e in events] == expected[prompt]
            assert pause <= failover_s + STALL_ALLOWANCE_S, f"{pause:.1f} s stalled"
        cluster.check_alive()
        # the gateway follows the sentinels on its own (every 0.25 s): its count may come a
        # moment after the test saw the new primary
        deadline = time.monotonic() + FOLLOW_S
        while True:
            metrics = (await http.get("/metrics")).text
            epochs = re.search(r"^textgen_redis_epoch_changes ([0-9]+)$", metrics, re.M)
            switches = re.search(r"^textgen_redis_master_switches ([0-9]+)$", metrics, re.M)
            assert epochs is not None and switches is not None
            counted = int(epochs.group(1)) >= 1 and int(switches.group(1)) >= 1
            if counted or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        waits = re.search(r"^textgen_intake_wait_seconds_count ([0-9.e+]+)$", metrics, re.M)
        assert waits and float(waits.group(1)) >= len(PROMPTS) + NUM_STREAMS  # WAIT 1 each
        # the reply subscription moves to a node of a new replication id (once as a rule; about
        # one T2 run in ten counted 2, not yet traced)
        assert int(epochs.group(1)) >= 1
        assert int(switches.group(1)) >= 1
