"""Load on the real services: 200 concurrent SSE streams all complete with contiguous token
indexes, and clients that hang up mid-generation free their KV blocks within 2 scheduler steps
of the server seeing the last hang-up, counted as tgi_request_failure{err="dropped"}.

Two is the designed worst case: an abort heard after the scheduler's loop applied aborts but
before it sent its plan still rides in that plan and is applied on the next loop turn; when
nothing else runs, the worker is then sent a plan that only releases the aborted requests."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from tests.e2e.test_pipeline import prompt_text
from tests.support.cluster import sse_events

NUM_STREAMS = 200
NUM_DROPPED = 20
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def load_gateway(tiny_cluster) -> str:
    return tiny_cluster.add_gateway("--max-concurrent-requests", "512")


def dropped(metrics: str) -> int:
    found = re.search(r'^tgi_request_failure\{err="dropped"\} (\d+)', metrics, re.M)
    return int(found.group(1)) if found else 0


def steps_run(metrics: str) -> int:
    """Steps the scheduler ran so far (updated every step, unlike its throttled stats)."""
    found = re.search(r"^textgen_scheduler_step_batch_size_count (\S+)", metrics, re.M)
    return int(float(found.group(1))) if found else 0


async def stream(http: httpx.AsyncClient, i: int) -> list[dict]:
    body = {"inputs": f"Request {i} says", "parameters": {"max_new_tokens": 16 + i % 17}}
    return await sse_events(http, body)


async def long_generation(http: httpx.AsyncClient, max_new_tokens: int) -> dict:
    """A greedy request that does not meet EOS before max_new_tokens (the model is random)."""
    for i in range(20):
        body = {"inputs": prompt_text(i, 8), "parameters": {"max_new_tokens": max_new_tokens}}
        response = await http.post(
            "/generate", json={**body, "parameters": {**body["parameters"], "details": True}}
        )
        if response.json()["details"]["finish_reason"] == "length":
            return body
    pytest.fail("every probe prompt met EOS")


def metrics_of(url: str) -> str:
    """The gateway's metrics on a connection of their own: the streams' client starts with an
    empty pool, so no stream is sent on a kept-alive connection the server may be closing."""
    return httpx.get(f"{url}/metrics", timeout=30).text


async def test_concurrent_streams(tiny_cluster, load_gateway):
    limits = httpx.Limits(max_connections=NUM_STREAMS + 10)
    before = dropped(metrics_of(load_gateway))
    async with httpx.AsyncClient(base_url=load_gateway, timeout=120, limits=limits) as http:
        started = time.monotonic()
        results = await asyncio.gather(*(stream(http, i) for i in range(NUM_STREAMS)))
        elapsed = time.monotonic() - started
        for i, events in enumerate(results):
            assert all("error" not in e for e in events), events[-1]
            indexes = [e["token"]["id"] is not None and e["index"] for e in events]
            assert indexes == list(range(1, len(events) + 1)), (i, indexes)
            assert events[-1]["generated_text"] is not None
            assert all(e["generated_text"] is None for e in events[:-1])
            assert events[-1]["index"] <= 16 + i % 17
        num_tokens = sum(len(events) for events in results)
        print(f"{NUM_STREAMS} streams, {num_tokens} tokens in {elapsed:.1f} s")
    assert dropped(metrics_of(load_gateway)) == before
    tiny_cluster.wait_idle()


async def test_disconnects_free_blocks(tiny_cluster, load_gateway):
    tiny_cluster.wait_idle()
    max_new_tokens = 300
    ops = {g: tiny_cluster.ops_urls[f"scheduler-{g}"] for g in tiny_cluster.groups}
    async with httpx.AsyncClient(base_url=load_gateway, timeout=60) as http:
        body = await long_generation(http, max_new_tokens)
        before = dropped((await http.get("/metrics")).text)

        async def first_event_then_close() -> None:
            async with http.stream("POST", "/generate_stream", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        assert "token" in json.loads(line[len("data:") :])
                        break
            # leaving the block closes the connection mid-generation

        await asyncio.gather(*(first_event_then_close() for _ in range(NUM_DROPPED)))
        # "the last hang-up" is when the server saw it: the gateway counts a drop as it
        # publishes the abort (steps counted from our own close would also count the time
        # the gateway's event loop took to notice, which a loaded machine stretches)
        deadline = time.monotonic() + 10
        while dropped((await http.get("/metrics")).text) - before < NUM_DROPPED:
            assert time.monotonic() < deadline, "the gateway did not see every hang-up"
            await asyncio.sleep(0.002)
        disconnected_at = time.monotonic()
        steps_at_disconnect = {
            g: steps_run((await http.get(f"{url}/metrics")).text) for g, url in ops.items()
        }
        deadline = time.monotonic() + 10
        while True:
            stats = tiny_cluster.stats()
            if all(s.num_free_blocks == s.num_blocks for s in stats.values()):
                break
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.005)
        freed_s = time.monotonic() - disconnected_at
        steps_after = {
            g: steps_run((await http.get(f"{url}/metrics")).text) - steps_at_disconnect[g]
            for g, url in ops.items()
        }
        print(f"blocks free {freed_s * 1000:.0f} ms, {steps_after} steps after the last hang-up")
        assert all(n <= 2 for n in steps_after.values()), steps_after
        assert all(s.num_running == 0 and s.num_waiting == 0 for s in stats.values())
        await asyncio.sleep(0.2)
        assert dropped((await http.get("/metrics")).text) - before == NUM_DROPPED
