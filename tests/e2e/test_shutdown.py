"""Graceful shutdown: SIGTERM on a worker group hands its unfinished requests to another group
(the client sees one unbroken, correct stream); SIGTERM on a gateway lets open streams finish."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.e2e.test_pipeline import prompt_text
from tests.support.reference import greedy_ids

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(own_cluster):
    # no grace: whatever g0 runs when it is stopped is handed back (the tiny model finishes a
    # few hundred tokens within half a second, which left nothing to hand back)
    return own_cluster("--shutdown-grace", "0", num_gateways=1)


def test_sigterm_on_a_worker_group_hands_requests_to_the_other(cluster, tiny_llama):
    url = cluster.gateway_urls[0]
    cases = [(prompt_text(i, 4 + i), 400 - 20 * i) for i in range(6)]

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            # g1 paused while the requests go out: g0 surely holds some when it is stopped
            # (else g1 could take them all); g0's taking them is read off the lanes, since a
            # stats snapshot may come only after g0 finished them all (429 steps once did)
            deadline = time.monotonic() + 60

            async def until(condition, what: str) -> None:
                while not condition():
                    assert time.monotonic() < deadline, f"{what}: {cluster.stats()}"
                    await asyncio.sleep(0.005)

            await until(lambda: cluster.taken_entries() == 0, "the probe's request never let go")
            with cluster.paused("scheduler-g1"):
                payloads = [
                    {"inputs": p, "parameters": {"max_new_tokens": n, "details": True}}
                    for p, n in cases
                ]
                tasks = [
                    asyncio.ensure_future(client.post(f"{url}/generate", json=payload))
                    for payload in payloads
                ]
                await until(lambda: cluster.taken_entries() > 0, "g0 took none")
                for name in ("scheduler-g0", "worker-g0"):  # a pod going away
                    cluster.processes[name].send_signal(signal.SIGTERM)
            return [(await t).json() for t in tasks]

    bodies = asyncio.run(scenario())
    for name in ("scheduler-g0", "worker-g0"):
        assert cluster.exit_code(name, timeout=30) == 0, cluster.log_tails()
    log_text = cluster.logs["scheduler-g0"].read_text()
    assert "handed back" in log_text, log_text[-3000:]
    for (prompt, n), body in zip(cases, bodies, strict=True):
        ids = [t["id"] for t in body["details"]["tokens"]]
        assert ids == greedy_ids(tiny_llama, prompt, n, [2]), prompt
        assert [i + 1 for i in range(len(ids))] == list(range(1, len(ids) + 1))


def test_sigterm_on_a_gateway_lets_open_streams_finish(cluster):
    url = cluster.add_gateway("--shutdown-grace", "30")
    gateway = cluster.processes["gateway-1"]
    events = []
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST",
            f"{url}/generate_stream",
            json={"inputs": "the cat", "parameters": {"max_new_tokens": 300, "details": True}},
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if len(events) == 1:
                        gateway.send_signal(signal.SIGTERM)
                        time.sleep(0.2)
                        with pytest.raises(httpx.TransportError):
                            httpx.get(f"{url}/health", timeout=2)  # no new connections
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["details"]["generated_tokens"] == len(events)
    stopped_at = time.monotonic()
    # uvicorn re-raises the SIGTERM it handled once shut down: -15 is a clean exit here
    assert gateway.wait(timeout=30) in (0, -signal.SIGTERM)
    print("gateway exit after", time.monotonic() - stopped_at)
