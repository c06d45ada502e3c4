"""The request lanes as one scheduler consumes them: the Redis side of taking requests in and
letting them go.

Requests are read (XREADGROUP, group "schedulers") most urgent lane first and never past the
room the group has (lanes.py: one round trip), the group's own stream before the lanes (the
requests gateways routed here because the group holds their LoRA adapter:
services/gateway/pipeline/routing.py); an idle scheduler blocks on all of them at once for the
next arrival; entries of schedulers that went silent are claimed, and the own streams of groups
that stopped beating or drain are read by whoever has room; held entries are kept fresh so
nobody claims them. An entry leaves the stream only when its request ended
(XACK, then XDEL), or is handed back (requeued with the tokens it already has). Unreadable
entries go to the dead letters; aborted and expired ones are acknowledged away unseen.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import redis
import redis.asyncio as aioredis
from redis.typing import KeyT, StreamIdT

from services.scheduler.aborts import AbortListener
from services.scheduler.lanes import LaneReader
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.recovery import (
    Unreadable,
    claim_abandoned,
    dead_letter,
    group_by_stream,
    keep_fresh,
    parse_request,
)
from services.scheduler.request import SchedRequest
from shared.bus import as_text, ensure_group, group_states, stream_fields
from shared.channels import SCHEDULER_GROUP, Channels
from shared.messages import GenerateRequest

log = logging.getLogger(__name__)

Taken = tuple[GenerateRequest, bytes, str]  # (request, its entry id, its lane)
IDLE_BLOCK_MS = 250  # an idle scheduler's wait for the next arrival, per read (a stop waits it out)
# Redis times a blocked read out only when its event loop wakes: at a command from anyone, else
# at its next cron tick (every 1/hz s: 100 ms by default). A late-planning wait of a few ms
# then lasted up to 100 ms whenever nothing else reached Redis (a quiet group: the worker idle
# meanwhile, token gaps of 50-100 ms at one stream). A command on the lanes' node once the wait
# is over wakes it, and the read ends on time.
WAKE_AFTER_S = 0.001  # past the wait's end, before a wake-up command (and between two)
# past a blocked read's end, the longest its reply may take: in a Redis Cluster kill -9 failover
# a scheduler's XREADGROUP once never returned (every stream stuck for minutes, both schedulers
# awaiting it); past this it counts as a lost connection, and the session starts again
READ_GRACE_S = 5.0


class RequestIntake:
    def __init__(
        self,
        redis: aioredis.Redis,
        channels: Channels,
        consumer: str,
        aborts: AbortListener,
        metrics: SchedulerMetrics,
        claim_timeout: float,
        group: str = "0",
    ) -> None:
        self.redis = redis
        self.channels = channels
        self.consumer = consumer  # this scheduler's name in the consumer group
        self.aborts = aborts  # ids whose entries are acknowledged away unseen
        self.metrics = metrics
        self.claim_timeout = claim_timeout  # s of silence before another scheduler claims
        self.group = group  # the worker group this scheduler drives
        # the group's own stream first (routed requests), then the lanes, most urgent first
        self.streams = [channels.directed(group), *channels.lanes]
        self.lanes = LaneReader(redis, self.streams, SCHEDULER_GROUP, consumer)
        self._grouped: set[str] = set()  # streams known to have the consumer group

    async def open(self) -> None:
        """Create the consumer group on every stream read where it is missing."""
        self._grouped.clear()
        for stream in self.streams:
            await self._ensure_group(stream)

    async def _ensure_group(self, stream: str) -> None:
        if stream not in self._grouped:
            await ensure_group(self.redis, stream, SCHEDULER_GROUP)
            self._grouped.add(stream)

    async def pull(self, room: int, block: bool, wait_s: float = 0.0) -> list[Taken]:
        """Up to `room` new requests, the most urgent lanes' first (one round trip); when
        there are none, wait on every lane for the next arrival: up to IDLE_BLOCK_MS when
        `block`, else up to `wait_s` (late planning; under a millisecond: no wait)."""
        entries = await self.lanes.read(room)
        block_ms = IDLE_BLOCK_MS if block else int(wait_s * 1000)
        if not entries and block_ms >= 1:
            lanes: dict[KeyT, StreamIdT] = {stream: ">" for stream in self.streams}
            read = asyncio.ensure_future(
                self.redis.xreadgroup(
                    SCHEDULER_GROUP, self.consumer, lanes, count=1, block=block_ms
                )
            )
            try:
                async with asyncio.timeout(block_ms / 1000 + READ_GRACE_S):
                    if not block:
                        await self._end_on_time(read, block_ms / 1000)
                    reply: Any = await read
            except TimeoutError:
                read.cancel()
                log.warning("no reply to a blocked read of the lanes: reconnecting")
                raise redis.TimeoutError("no reply to XREADGROUP on the lanes") from None
            entries = [
                (as_text(lane), entry_id, fields)
                for lane, lane_entries in reply or []
                for entry_id, fields in lane_entries
            ]
        return await self._take_all(entries)

    async def _end_on_time(self, read: asyncio.Future[Any], wait_s: float) -> None:
        """Wake Redis (WAKE_AFTER_S after `wait_s`, and every WAKE_AFTER_S after that) while
        `read` is still blocked, so that it times out now rather than at Redis's next tick."""
        try:
            timeout = wait_s + WAKE_AFTER_S
            while not (await asyncio.wait({read}, timeout=timeout))[0]:
                # to the lanes' node, as `read` went; again while Redis's clock had not reached
                # the read's end (it counts whole ms from the read's arrival)
                await self.redis.exists(self.streams[-1])
                self.metrics.plan_wait_wakes.inc()
                timeout = WAKE_AFTER_S
        except BaseException:
            read.cancel()  # cancelled, or Redis failed: the caller's retry reads again
            raise

    async def own_pending(self) -> list[Taken]:
        """The entries this scheduler took and has not acknowledged (a session reset by a
        Redis outage or failover takes its requests again at once, instead of waiting
        claim_timeout for its own entries to look abandoned)."""
        entries: list[tuple[str, bytes, dict[bytes, bytes]]] = []
        for stream in self.streams:
            reply: Any = await self.redis.xreadgroup(
                SCHEDULER_GROUP, self.consumer, {stream: "0"}, count=10_000
            )
            entries += [
                (stream, entry_id, fields)
                for _, got in reply or []
                for entry_id, fields in got
                if fields  # deleted since: nothing to take
            ]
        if entries:
            log.info("took back %d requests of this scheduler's last session", len(entries))
        return await self._take_all(entries)

    async def claim(self, room: int) -> list[Taken]:
        """Up to `room` requests: those routed to groups that stopped beating or drain and
        not yet read, then those of schedulers silent for claim_timeout (on every stream)."""
        orphaned, own_streams = await self._orphaned_streams()
        entries: list[tuple[str, bytes, dict[bytes, bytes]]] = []
        for stream in orphaned:
            if len(entries) >= room:
                break
            await self._ensure_group(stream)
            reply: Any = await self.redis.xreadgroup(
                SCHEDULER_GROUP, self.consumer, {stream: ">"}, count=room - len(entries)
            )
            entries += [
                (stream, entry_id, fields) for _, got in reply or [] for entry_id, fields in got
            ]
        if entries:
            log.warning("took %d requests routed to a group that is gone or draining", len(entries))
            self.metrics.orphaned.inc(len(entries))
        for stream in own_streams:
            await self._ensure_group(stream)
        claimed = await claim_abandoned(
            self.redis,
            [*self.channels.lanes, *own_streams],
            self.consumer,
            self.claim_timeout,
            room - len(entries),
        )
        self.metrics.claimed.inc(len(claimed))
        return await self._take_all(entries + claimed)

    async def _orphaned_streams(self) -> tuple[list[str], list[str]]:
        """The own streams of the groups that stopped beating or drain (this one's aside),
        and those of every known group."""
        states = await group_states(self.redis, self.channels)
        orphaned = [
            self.channels.directed(group)
            for group, beat, draining in states
            if group != self.group and (beat is None or draining)
        ]
        return orphaned, [self.channels.directed(group) for group, _, _ in states]

    async def _take_all(self, entries: list[tuple[str, bytes, dict[bytes, bytes]]]) -> list[Taken]:
        """The requests of `entries` that are to be scheduled (counted as pulled)."""
        taken = [await self._take(lane, entry_id, fields) for lane, entry_id, fields in entries]
        kept = [t for t in taken if t is not None]
        self.metrics.pulled.inc(len(kept))
        return kept

    async def _take(self, lane: str, entry_id: bytes, fields: dict[bytes, bytes]) -> Taken | None:
        """The entry's request, or None once it is acknowledged away (aborted, expired,
        unreadable: dead-lettered; never stops the consumer)."""
        try:
            message = parse_request(fields)
        except Unreadable as exc:
            await dead_letter(self.redis, self.channels, lane, entry_id, fields, str(exc))
            await self.ack([(lane, entry_id)])
            return None
        if self.aborts.covers(message.request_id, message.attempt) or (
            message.deadline and message.deadline < time.time()
        ):
            log.info(
                "request %s: attempt %d dropped as it was taken (aborted or past its deadline)",
                message.request_id,
                message.attempt,
            )
            await self.ack([(lane, entry_id)])
            return None
        return message, entry_id, lane

    async def ack(self, entries: Iterable[tuple[str, bytes]]) -> None:
        """XACK then XDEL (lane, entry id) pairs: the lanes keep only unfinished requests."""
        by_stream = group_by_stream(list(entries))
        if not by_stream:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream, entry_ids in by_stream.items():
                pipe.xack(stream, SCHEDULER_GROUP, *entry_ids)
                pipe.xdel(stream, *entry_ids)
            await pipe.execute()

    async def hand_back(self, requests: list[SchedRequest]) -> None:
        """Requeue requests with the tokens they already have, so another group continues
        each stream where it stopped (the gateway skips the indexes it delivered)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for request in requests:
                resumed = msgspec.structs.replace(
                    request.message, generated_ids=request.token_ids[request.num_prompt_tokens :]
                )
                pipe.xadd(self.channels.lane(resumed.priority), stream_fields(resumed))
            await pipe.execute()
        self.metrics.handed_back.inc(len(requests))

    async def keep_fresh(self, entries: list[tuple[str, bytes]]) -> None:
        """Reset the held entries' (stream, entry id) idle time, so nobody claims them."""
        await keep_fresh(self.redis, self.consumer, entries)
