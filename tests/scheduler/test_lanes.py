"""The one-round-trip lane read on a real Redis: urgent lanes first, never more than the room,
what is left stays for another consumer, and it is one command (one round trip)."""

from __future__ import annotations

import contextlib

import pytest
import redis.asyncio as aioredis

from services.scheduler.lanes import LaneReader
from shared.bus import ensure_group
from shared.channels import SCHEDULER_GROUP, Channels
from tests.support.redis_server import redis_server


@pytest.fixture(scope="module")
def own_redis_url():
    """A Redis no other test's services use, so its command counts are this module's."""
    with redis_server() as url:
        yield url


@contextlib.asynccontextmanager
async def filled(url: str, namespace: str, counts: dict[int, int]):
    """A client, and the lanes of `namespace` holding counts[priority] entries each
    ("priority/i"), with the schedulers' consumer group."""
    client = aioredis.from_url(url)
    channels = Channels(namespace)
    try:
        for lane in channels.lanes:
            await ensure_group(client, lane, SCHEDULER_GROUP)
        for priority, count in counts.items():
            for i in range(count):
                await client.xadd(channels.lane(priority), {b"m": f"{priority}/{i}".encode()})
        yield client, channels
    finally:
        await client.aclose()


def calls(commandstats: dict, command: str) -> int:
    return commandstats.get(f"cmdstat_{command}", {}).get("calls", 0)


def taken(entries) -> list[str]:
    return [fields[b"m"].decode() for _lane, _entry_id, fields in entries]


async def test_urgent_lanes_first_and_never_past_the_room(redis_url, namespace):
    async with filled(redis_url, namespace, {1: 2, 0: 3, -1: 2}) as (client, channels):
        first = LaneReader(client, channels.lanes, SCHEDULER_GROUP, "g0-a")
        entries = await first.read(4)
        assert taken(entries) == ["1/0", "1/1", "0/0", "0/1"]
        assert [lane for lane, _, _ in entries] == [channels.lane(1)] * 2 + [channels.lane(0)] * 2
        # the rest is another consumer's to take, in the same order
        second = LaneReader(client, channels.lanes, SCHEDULER_GROUP, "g1-b")
        assert taken(await second.read(10)) == ["0/2", "-1/0", "-1/1"]
        assert await first.read(10) == []
        # what was taken is pending for its consumer, as XREADGROUP leaves it
        pending = await client.xpending(channels.lane(0), SCHEDULER_GROUP)
        assert {c["name"]: c["pending"] for c in pending["consumers"]} == {
            b"g0-a": 2,
            b"g1-b": 1,
        }


async def test_no_room_reads_nothing(redis_url, namespace):
    async with filled(redis_url, namespace, {0: 2}) as (client, channels):
        reader = LaneReader(client, channels.lanes, SCHEDULER_GROUP, "g0-a")
        assert await reader.read(0) == []
        assert taken(await reader.read(5)) == ["0/0", "0/1"]


async def test_one_round_trip(own_redis_url, namespace):
    async with filled(own_redis_url, namespace, {1: 1, 0: 1, -1: 1}) as (client, channels):
        reader = LaneReader(client, channels.lanes, SCHEDULER_GROUP, "g0-a")
        await reader.read(0)  # loads the script
        before = await client.info("commandstats")
        assert len(await reader.read(3)) == 3
        after = await client.info("commandstats")
        assert calls(after, "evalsha") - calls(before, "evalsha") == 1
        # the three reads ran inside that one command
        assert calls(after, "xreadgroup") - calls(before, "xreadgroup") == 3
