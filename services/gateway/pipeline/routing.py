"""Where a request for a LoRA adapter goes: to the worker group that holds it, when one does.

Worker groups list the adapters they hold in their heartbeats (`Heartbeat.adapters`). A
request whose adapter a live, undrained group holds is added to that group's own stream
(`Channels.directed`) instead of its priority lane, so it runs where the adapter is loaded
instead of loading it into a second group (evicting another there); of several holders, the
one holding the fewest requests. Otherwise the request takes its lane like any other, and the
group that pulls it loads the adapter. Schedulers take a group's stream over once the group
stops beating or drains (services/scheduler/intake.py), so routing never strands a request.

    heartbeat g0: adapters [a1]      request for a1 -> {textgen}:directed:g0
    heartbeat g1: adapters [a2]      request for a3 -> {textgen}:requests (its priority lane)

The view of the groups is read at most every REFRESH_S (SMEMBERS, then the groups' heartbeats
and drain keys in one pipelined round trip) and shared by every request of the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import redis.asyncio as aioredis

from shared.bus import REDIS_ERRORS, group_states
from shared.channels import Channels
from shared.codec import decode
from shared.messages import Heartbeat

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # how stale the gateway's view of the adapters' holders may be


class AdapterRoutes:
    def __init__(self, redis: aioredis.Redis, channels: Channels) -> None:
        self.redis = redis
        self.channels = channels
        self._holders: dict[str, list[tuple[int, str]]] = {}  # id -> (requests held, group)
        self._read_at = float("-inf")  # monotonic s of the last read
        self._lock = asyncio.Lock()

    async def group_for(self, adapter_id: str) -> str | None:
        """The live, undrained group holding `adapter_id` with the fewest requests, or None
        (none holds it, or Redis did not answer: the lane then takes the request)."""
        if time.monotonic() - self._read_at >= REFRESH_S:
            async with self._lock:
                if time.monotonic() - self._read_at >= REFRESH_S:
                    try:
                        self._holders = await self._read()
                    except REDIS_ERRORS as exc:
                        log.debug("adapter routes not refreshed: %s", exc)
                    self._read_at = time.monotonic()
        holders = self._holders.get(adapter_id)
        return min(holders)[1] if holders else None

    async def _read(self) -> dict[str, list[tuple[int, str]]]:
        holders: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for group, beat, draining in await group_states(self.redis, self.channels):
            if beat is None or draining:
                continue
            heartbeat = decode(beat, Heartbeat)
            for adapter_id in heartbeat.adapters:
                holders[adapter_id].append((heartbeat.num_requests, group))
        return holders
