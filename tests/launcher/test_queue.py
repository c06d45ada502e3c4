"""`textgen queue`: the read-only view on fabricated Redis state (exact numbers, nothing written),
then against a live stack with requests waiting in the stream, and drain/undrain of a group."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from services.launcher.queue_view import NOT_IN_STREAM, QueueView
from shared.bus import FIELD
from shared.channels import SCHEDULER_GROUP, Channels
from shared.codec import decode, encode
from shared.messages import (
    GenerateRequest,
    Heartbeat,
    SamplingParams,
    SchedulerStats,
    StoppingParams,
    WorkerReady,
)
from tests.e2e.conftest import CLUSTER_ARGS
from tests.support.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]


def textgen_queue(redis_url: str, namespace: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "NAMESPACE")}
    return subprocess.run(
        [sys.executable, "-m", "services.launcher.cli", "queue", *args]
        + ["--redis-url", redis_url, "--namespace", namespace],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def queue_json(redis_url: str, namespace: str, *args: str) -> dict:
    result = textgen_queue(redis_url, namespace, "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def request_message(request_id: str, num_input: int = 3) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        input_ids=list(range(1, num_input + 1)),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=7),
        reply_to="reply:gw",
        created_at=time.time(),
        deadline=time.time() + 60,
    )


def dump_namespace(client: redis.Redis, namespace: str) -> dict[bytes, bytes]:
    """Every key of the namespace with its serialized value (consumer groups included): those
    under its shared hash tag ({ns}:...) and its groups' ({ns:group:<g>}:...)."""
    keys = client.scan_iter("{" + namespace + "[:}]*")
    return {key: client.dump(key) for key in keys}


@pytest.fixture
def fabricated(redis_url, namespace):
    """Two groups: g0 alive, holding one request (its consumer read it); g1 announced but dead
    (no heartbeat, no stats) and drained; three requests in the stream, two never delivered."""
    client = redis.Redis.from_url(redis_url)
    channels = Channels(namespace)
    for request_id in ("r-a", "r-b", "r-c"):
        client.xadd(channels.requests, {FIELD: encode(request_message(request_id))})
    client.xgroup_create(channels.requests, SCHEDULER_GROUP, id="0")
    client.xreadgroup(SCHEDULER_GROUP, "g0-aaaa1111", {channels.requests: ">"}, count=1)
    client.sadd(channels.groups, "g0", "g1")
    for group in ("g0", "g1"):
        ready = WorkerReady(
            group=group,
            model_id="tiny",
            num_blocks=64,
            block_size=16,
            max_batch_size=4,
            max_model_len=512,
        )
        client.set(channels.worker(group), encode(ready))
    client.set(channels.heartbeat("g0"), encode(Heartbeat(group="g0", at=time.time() - 0.5)))
    stats = SchedulerStats(
        group="g0", at=time.time(), num_running=1, num_blocks=64, num_free_blocks=48
    )
    client.set(channels.scheduler_stats("g0"), encode(stats))
    client.set(channels.drain("g1"), b"1")
    yield client
    client.close()


def test_snapshot_of_fabricated_state(fabricated, namespace):
    snapshot = QueueView(fabricated, namespace).snapshot()
    stream = snapshot.stream
    assert (stream.length, stream.num_pending, stream.num_queued, stream.lag) == (3, 1, 2, 2)
    assert 0 <= stream.oldest_age_s < 5
    assert [(c.name, c.group, c.num_pending) for c in snapshot.consumers] == [
        ("g0-aaaa1111", "g0", 1)
    ]
    g0, g1 = snapshot.groups
    assert (g0.group, g0.state, g0.num_blocks, g0.num_used_blocks, g0.kv_use_pct) == (
        "g0",
        "ok",
        64,
        16,
        25.0,
    )
    assert g0.num_pending == 1 and g0.num_running == 1 and 0.4 < g0.heartbeat_age_s < 5
    assert (g1.state, g1.heartbeat_age_s, g1.drain_requested, g1.num_running) == (
        "dead, drained",
        None,
        True,
        None,
    )


def test_request_state_by_id(fabricated, namespace):
    view = QueueView(fabricated, namespace)
    held = view.request_state("r-a")
    assert held.state == "assigned to g0-aaaa1111" and held.group == "g0"
    assert held.num_deliveries == 1 and held.num_input_tokens == 3 and held.max_new_tokens == 7
    last = view.request_state("r-c")
    assert (last.state, last.queue_position) == ("queued", 1)
    assert view.request_state("nope").state == NOT_IN_STREAM


def test_read_only_commands_do_not_change_redis(fabricated, redis_url, namespace):
    before = dump_namespace(fabricated, namespace)
    # every key outside the namespace too, but those that expire (an earlier test's cluster's
    # heartbeats may go while this runs)
    lasting = {key for key in fabricated.scan_iter() if fabricated.ttl(key) == -1}
    assert len(before) == 7  # the fixture's keys, both hash tags' (shared/channels.py)
    snapshot = queue_json(redis_url, namespace)
    assert snapshot["stream"]["length"] == 3 and len(snapshot["groups"]) == 2
    assert queue_json(redis_url, namespace, "request", "r-b")["state"] == "queued"
    human = textgen_queue(redis_url, namespace)
    assert human.returncode == 0 and "g0-aaaa1111" in human.stdout and "dead" in human.stdout
    human = textgen_queue(redis_url, namespace, "request", "r-a")
    assert "assigned to g0-aaaa1111" in human.stdout
    assert {key for key in fabricated.scan_iter() if fabricated.ttl(key) == -1} == lasting
    assert dump_namespace(fabricated, namespace) == before


def test_drain_and_undrain_write_only_the_drain_key(fabricated, redis_url, namespace):
    key = Channels(namespace).drain("g0")
    result = textgen_queue(redis_url, namespace, "drain", "g0", "--no-wait")
    assert result.returncode == 0 and fabricated.exists(key)
    result = textgen_queue(redis_url, namespace, "undrain", "g0", "--no-wait")
    assert result.returncode == 0 and not fabricated.exists(key)


def test_without_redis_url_it_says_so(namespace):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    result = subprocess.run(
        [sys.executable, "-m", "services.launcher.cli", "queue"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 2 and "REDIS_URL" in result.stderr


# --- live stack -------------------------------------------------------------------------------

LIVE_NAMESPACE = "queue-live"
MAX_BATCH = 2
STEP_MS = 15  # the simulated workers' step: a wave of 150-token requests takes 2.25 s


@pytest.fixture(scope="module")
def live_cluster(redis_url, tiny_llama):
    """Two groups of at most 2 running requests each, so that a burst waits in the stream;
    simulated workers (a step takes STEP_MS, whatever the host's speed), so that requests
    stay queued for a known time: the real tiny Llama makes 150 tokens in a fraction of a
    second, and the live view then found the stream already empty."""
    args = [*CLUSTER_ARGS, "--max-batch-size", str(MAX_BATCH), "--fake-step-ms", str(STEP_MS)]
    cluster = Cluster(redis_url, LIVE_NAMESPACE, tiny_llama, num_groups=2, args=args)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


async def generate(client: httpx.AsyncClient, url: str, i: int, max_new_tokens: int) -> dict:
    response = await client.post(
        f"{url}/generate",
        json={
            "inputs": f"request {i} tells a long story about",
            "parameters": {"max_new_tokens": max_new_tokens, "details": True},
        },
    )
    assert response.status_code == 200, response.text
    return response.json()


def finished_per_group(cluster: Cluster) -> dict[str, int]:
    return {group: stats.num_finished for group, stats in cluster.stats().items()}


@pytest.mark.integration
def test_live_view_while_requests_wait(live_cluster, redis_url):
    cluster, url = live_cluster, live_cluster.gateway_urls[0]
    cluster.wait_idle()
    client = redis.Redis.from_url(redis_url)
    requests_key = Channels(LIVE_NAMESPACE).requests
    num_requests, num_tokens = 10, 150

    async def run() -> tuple[str, dict, dict, list[dict]]:
        async with httpx.AsyncClient(timeout=120) as http:
            tasks = [
                asyncio.ensure_future(generate(http, url, i, num_tokens))
                for i in range(num_requests)
            ]
            deadline = time.monotonic() + 10
            while client.xlen(requests_key) < num_requests and time.monotonic() < deadline:
                await asyncio.sleep(0.02)  # until every request reached the stream
            # the last entry is the last one any scheduler gets: it stays queued while the
            # first two waves (2 groups x 2 requests each) generate their tokens (4.5 s)
            last_entry = client.xrevrange(requests_key, count=1)[0]
            request_id = decode(last_entry[1][FIELD], GenerateRequest).request_id
            state, snapshot = await asyncio.gather(
                asyncio.to_thread(queue_json, redis_url, LIVE_NAMESPACE, "request", request_id),
                asyncio.to_thread(queue_json, redis_url, LIVE_NAMESPACE),
            )
            return request_id, snapshot, state, await asyncio.gather(*tasks)

    request_id, snapshot, state, bodies = asyncio.run(run())
    stream, groups = snapshot["stream"], snapshot["groups"]
    assert stream["length"] >= stream["num_queued"] > 0
    assert stream["length"] == stream["num_queued"] + stream["num_pending"]
    assert 0 < stream["num_pending"] <= 2 * MAX_BATCH
    assert stream["oldest_age_s"] < 30
    assert [g["group"] for g in groups] == ["g0", "g1"]
    ready = cluster_ready(redis_url)
    for group in groups:
        assert group["state"] == "ok" and group["heartbeat_age_s"] < 5
        assert group["num_blocks"] == ready[group["group"]].num_blocks
        assert 0 < group["num_running"] <= MAX_BATCH
        assert 0 < group["kv_use_pct"] <= 100
    pending = {c["group"]: 0 for c in snapshot["consumers"]}
    for consumer in snapshot["consumers"]:
        pending[consumer["group"]] += consumer["num_pending"]
    assert sum(pending.values()) == stream["num_pending"]
    assert all(0 < pending[g["group"]] <= MAX_BATCH for g in groups)
    assert state["request_id"] == request_id and state["entry_id"] is not None
    assert state["state"] == "queued"
    assert 0 <= state["queue_position"] < num_requests - 2 * MAX_BATCH
    assert state["max_new_tokens"] == num_tokens and state["num_input_tokens"] > 0
    assert len(bodies) == num_requests

    cluster.wait_idle()
    after = queue_json(redis_url, LIVE_NAMESPACE)
    assert after["stream"]["length"] == 0 and after["stream"]["num_pending"] == 0
    assert all(c["num_pending"] == 0 for c in after["consumers"])
    for group in after["groups"]:
        assert group["num_free_blocks"] == group["num_blocks"] and group["num_running"] == 0
    gone = queue_json(redis_url, LIVE_NAMESPACE, "request", state["request_id"])
    assert gone["state"] == NOT_IN_STREAM


def cluster_ready(redis_url: str) -> dict[str, WorkerReady]:
    client = redis.Redis.from_url(redis_url)
    channels = Channels(LIVE_NAMESPACE)
    return {g: decode(client.get(channels.worker(g)), WorkerReady) for g in ("g0", "g1")}


@pytest.mark.integration
def test_drain_sends_new_requests_to_the_other_group(live_cluster, redis_url):
    cluster, url = live_cluster, live_cluster.gateway_urls[0]

    async def burst(num: int, max_new_tokens: int = 8) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(generate(http, url, i, max_new_tokens) for i in range(num)))

    cluster.wait_idle()
    drained = textgen_queue(redis_url, LIVE_NAMESPACE, "drain", "g0")
    assert drained.returncode == 0 and "confirmed" in drained.stdout, drained.stderr
    try:
        assert cluster.stats()["g0"].draining and not cluster.stats()["g1"].draining
        view = queue_json(redis_url, LIVE_NAMESPACE)
        assert [g["state"] for g in view["groups"]] == ["draining", "ok"]
        before = finished_per_group(cluster)
        asyncio.run(burst(6))
        cluster.wait_idle()
        after = finished_per_group(cluster)
        assert after["g0"] == before["g0"] and after["g1"] == before["g1"] + 6
    finally:
        undrained = textgen_queue(redis_url, LIVE_NAMESPACE, "undrain", "g0")
    assert undrained.returncode == 0 and "confirmed" in undrained.stdout, undrained.stderr
    assert not cluster.stats()["g0"].draining
    before = finished_per_group(cluster)
    # more than g1 holds at once, each long enough that g1 is still busy with its first two
    # when g0 reads again (with 8 tokens g1 took all 8 once, in a full suite on 2 busy cores)
    asyncio.run(burst(8, 64))
    cluster.wait_idle()
    after = finished_per_group(cluster)
    assert after["g0"] > before["g0"]
    assert sum(after.values()) - sum(before.values()) == 8
