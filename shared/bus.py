"""A small layer over Redis: typed messages in and out of streams, keys and pub/sub.

Services own their loops; this module only knows how messages map to Redis commands.
Everything is asyncio (redis.asyncio); callers batch work with `pipeline()` where it matters.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import (
    ClusterDownError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.typing import EncodableT, FieldT

from shared.codec import decode, encode

if TYPE_CHECKING:
    from shared.channels import Channels

T = TypeVar("T")
log = logging.getLogger(__name__)

FIELD = b"m"  # stream entries hold one field whose value is the msgpack message
# what a Redis outage raises: loops catch these, back off and retry. A Redis Cluster failing
# over answers CLUSTERDOWN (a slot has no live primary yet: every node says so until a replica
# takes over) or TRYAGAIN, and its client raises RedisClusterException when the nodes it asks
# cannot agree on the slots or cover them all (SlotNotCoveredError is one)
REDIS_ERRORS = (
    aioredis.ConnectionError,
    aioredis.TimeoutError,
    ClusterDownError,
    TryAgainError,
    RedisClusterException,
    OSError,
    TimeoutError,
)
# any failure of a Redis command: an outage's errors, or Redis refusing it (where a request
# gets its 503 and a probe its "no")
REDIS_FAILURES = (RedisError, *REDIS_ERRORS)


async def group_states(
    client: aioredis.Redis, channels: Channels
) -> list[tuple[str, bytes | None, bool]]:
    """Every registered worker group: (group, its Heartbeat's bytes or None once it stopped
    beating, whether it drains), in two round trips."""
    groups = sorted(as_text(raw) for raw in await client.smembers(channels.groups))
    async with client.pipeline(transaction=False) as pipe:
        for group in groups:
            pipe.get(channels.heartbeat(group))
            pipe.exists(channels.drain(group))
        replies = await pipe.execute()
    return [
        (group, beat, bool(draining))
        for group, beat, draining in zip(groups, replies[::2], replies[1::2], strict=True)
    ]


async def wait_for_redis(client: aioredis.Redis, timeout: float = 30.0) -> None:
    """Wait until Redis answers PING (start-up ordering in compose/k8s)."""
    deadline = asyncio.get_running_loop().time() + timeout
    delay = 0.05
    while True:
        try:
            await client.ping()
            return
        except (OSError, aioredis.ConnectionError) as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise ConnectionError(f"Redis unreachable: {exc}") from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


def stream_fields(message: msgspec.Struct) -> dict[FieldT, EncodableT]:
    """Fields of a stream entry holding `message`."""
    return {FIELD: encode(message)}


def pairs_to_fields(pairs: list[bytes]) -> dict[bytes, bytes]:
    """A stream entry's fields from the flat [field, value, ...] list a script returns."""
    return dict(zip(pairs[::2], pairs[1::2], strict=True))


def entry_message(fields: dict[bytes, bytes], kind: type[T]) -> T:
    """The message inside a stream entry."""
    return decode(fields[FIELD], kind)


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    """Create a consumer group (and the stream) if missing."""
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def read_stream(
    client: aioredis.Redis, stream: str, last_id: bytes, kind: type[T], block_ms: int | None
) -> list[tuple[bytes, T]]:
    """XREAD entries after `last_id` (blocking up to block_ms; None = do not block)."""
    return stream_entries(await client.xread({stream: last_id}, block=block_ms), kind)


def stream_entries(reply: Any, kind: type[T]) -> list[tuple[bytes, T]]:
    """The (entry id, message) pairs of an XREAD reply (None when it timed out)."""
    out: list[tuple[bytes, T]] = []
    for _name, entries in reply or []:
        for entry_id, fields in entries:
            out.append((entry_id, entry_message(fields, kind)))
    return out


async def get_message(client: aioredis.Redis, key: str, kind: type[T]) -> T | None:
    """The message stored under a key, or None."""
    data = await client.get(key)
    return None if data is None else decode(as_bytes(data), kind)


def as_text(value: bytes | str) -> str:
    """A Redis reply as text."""
    return value.decode() if isinstance(value, bytes) else value


def as_bytes(value: bytes | str) -> bytes:
    """A Redis reply as bytes (clients made with decode_responses hand over str)."""
    return value.encode() if isinstance(value, str) else value
