"""What keeps requests alive when parts die (design §6), as Redis calls for the service loop.

- Every scheduler keeps the requests it holds "fresh" in the consumer group (XCLAIM to itself
  with JUSTID resets their idle time); a request idle longer than --claim-timeout therefore
  belongs to a dead scheduler, and any live one takes it over with XAUTOCLAIM. The taker
  replays it from its prompt: seeded sampling makes the replay exact, and the gateway skips
  the token indexes it already delivered.
- Entries nobody can read (malformed bytes, a newer schema version) go to the dead-letter
  stream with the reason, and are acknowledged, so they never block or kill a consumer.
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis

from shared.bus import FIELD, entry_message
from shared.channels import DEAD_LETTERS_MAXLEN, SCHEDULER_GROUP, Channels
from shared.messages import SCHEMA_VERSION, GenerateRequest

log = logging.getLogger(__name__)


class Unreadable(ValueError):
    """A stream entry that is not a GenerateRequest this scheduler can run."""


def parse_request(fields: dict[bytes, bytes]) -> GenerateRequest:
    """The request in a stream entry; raises Unreadable with the reason."""
    try:
        message = entry_message(fields, GenerateRequest)
    except Exception as exc:  # msgspec errors, missing field, garbage bytes
        raise Unreadable(f"malformed: {type(exc).__name__}: {exc}") from exc
    if message.v > SCHEMA_VERSION:
        raise Unreadable(f"schema version {message.v} is newer than {SCHEMA_VERSION}")
    return message


async def dead_letter(
    redis: aioredis.Redis,
    channels: Channels,
    source: str,
    entry_id: bytes,
    fields: dict[bytes, bytes],
    reason: str,
) -> None:
    """Keep an unreadable entry for operators (with where it came from and why)."""
    log.error("dead-lettering entry %s of %s: %s", entry_id, source, reason)
    await redis.xadd(
        channels.dead_letters,
        {
            b"source": source.encode(),
            b"entry_id": entry_id,
            b"reason": reason.encode(),
            b"at": str(time.time()).encode(),
            FIELD: fields.get(FIELD, b""),
        },
        maxlen=DEAD_LETTERS_MAXLEN,
        approximate=True,
    )


def group_by_stream(entries: list[tuple[str, bytes]]) -> dict[str, list[bytes]]:
    """(stream, entry id) pairs by stream, without the placeholder id of in-process tests."""
    by_stream: dict[str, list[bytes]] = {}
    for stream, entry_id in entries:
        if stream and entry_id != b"0-0":
            by_stream.setdefault(stream, []).append(entry_id)
    return by_stream


async def keep_fresh(
    redis: aioredis.Redis, consumer: str, entries: list[tuple[str, bytes]]
) -> None:
    """Reset the idle time of the entries this scheduler holds, so nobody claims them."""
    for stream, entry_ids in group_by_stream(entries).items():
        ids: list[int | bytes | str | memoryview] = list(entry_ids)
        await redis.xclaim(stream, SCHEDULER_GROUP, consumer, 0, ids, justid=True)


async def claim_abandoned(
    redis: aioredis.Redis, lanes: list[str], consumer: str, min_idle_s: float, count: int
) -> list[tuple[str, bytes, dict[bytes, bytes]]]:
    """Take over up to `count` (stream, entry id, fields) idle for min_idle_s, in the order of
    `lanes` (most urgent first; their scheduler is gone)."""
    claimed: list[tuple[str, bytes, dict[bytes, bytes]]] = []
    for lane in lanes:
        start = b"0-0"
        while len(claimed) < count:
            reply = await redis.xautoclaim(
                lane,
                SCHEDULER_GROUP,
                consumer,
                int(min_idle_s * 1000),
                start_id=start,
                count=count - len(claimed),
            )
            start, entries = reply[0], reply[1]
            claimed.extend((lane, entry_id, fields) for entry_id, fields in entries if fields)
            if start in (b"0-0", "0-0"):
                break
    if claimed:
        log.warning("claimed %d requests of a silent scheduler", len(claimed))
    return claimed
