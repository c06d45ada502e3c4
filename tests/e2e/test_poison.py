"""Poisoned bus messages (garbage bytes, wrong types, a newer schema version) are logged and
dead-lettered; no consumer dies and the stack keeps serving."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
import redis

from shared.bus import FIELD
from shared.channels import Channels
from shared.messages import SCHEMA_VERSION, GenerateRequest, SamplingParams, StoppingParams

pytestmark = pytest.mark.integration


def newer_request() -> bytes:
    message = GenerateRequest(
        v=SCHEMA_VERSION + 1,
        request_id="from-the-future",
        input_ids=[1, 5],
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=2),
        reply_to="nobody",
        created_at=time.time(),
        deadline=time.time() + 60,
    )
    return msgspec.msgpack.encode(message)


def test_garbage_on_every_bus_is_dead_lettered_and_nothing_dies(tiny_cluster):
    client = redis.Redis.from_url(tiny_cluster.redis_url)
    channels = Channels(tiny_cluster.namespace)
    before = client.xlen(channels.dead_letters)
    for lane in channels.lanes:
        client.xadd(lane, {FIELD: b"\xc1\xff not msgpack"})
    client.xadd(channels.requests, {FIELD: msgspec.msgpack.encode({"request_id": 7})})
    client.xadd(channels.requests, {FIELD: newer_request()})
    client.xadd(channels.requests, {b"other": b"field"})
    for group in tiny_cluster.groups:
        client.xadd(channels.steps(group), {FIELD: b"\x00garbage"})
    client.publish(channels.aborts, b"\xff\xfe")
    client.publish(channels.reply("gw0"), b"\xff\xfe")
    deadline = time.monotonic() + 20
    while client.xlen(channels.dead_letters) < before + 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    letters = client.xrange(channels.dead_letters)[before:]
    reasons = [fields[b"reason"].decode() for _id, fields in letters]
    assert len(reasons) == 8, reasons
    assert any("newer than" in r for r in reasons)
    assert sum("StepPlan" in r for r in reasons) == len(tiny_cluster.groups)
    assert all(client.xlen(lane) == 0 for lane in channels.lanes)  # acknowledged away
    tiny_cluster.check_alive()
    for url in tiny_cluster.gateway_urls:
        response = httpx.post(
            f"{url}/generate",
            timeout=60,
            json={"inputs": "the cat", "parameters": {"max_new_tokens": 4}},
        )
        assert response.status_code == 200
    assert all(s.num_free_blocks == s.num_blocks for s in tiny_cluster.wait_idle().values())
