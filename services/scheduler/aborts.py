"""Hearing AbortRequests (gateways publish them on {textgen}:aborts when a client goes away, a stop
string matched or a deadline passed). Every scheduler hears every abort; the one holding the
request drops it, and the ids are remembered for a while so a request still in the stream is
dropped when it is pulled."""

from __future__ import annotations

import contextlib
import logging
import time

import redis.asyncio as aioredis

from shared.bus import REDIS_ERRORS
from shared.channels import Channels
from shared.codec import decode
from shared.master_watch import MasterWatch, address_of
from shared.messages import AbortRequest
from shared.redis_connect import pubsub_of

log = logging.getLogger(__name__)


class AbortListener:
    def __init__(
        self,
        redis: aioredis.Redis,
        channels: Channels,
        memory_s: float,
        master: MasterWatch | None = None,
    ) -> None:
        self.redis = redis
        # the sentinels' master: gateways publish there, so the subscription follows it
        self.master = master or MasterWatch(None, "")
        self.channels = channels
        self.memory_s = memory_s  # how long an abort is remembered (the request timeout)
        # request_id -> (unix s heard, below_attempt: 0 covers every attempt)
        self.heard: dict[str, tuple[float, int]] = {}

    def covers(self, request_id: str, attempt: int) -> bool:
        """An abort was heard for this attempt of the request."""
        heard = self.heard.get(request_id)
        return heard is not None and (heard[1] == 0 or attempt < heard[1])

    def recent(self) -> list[tuple[str, int]]:
        """(id, below_attempt) heard within memory_s (older ones are forgotten)."""
        horizon = time.time() - self.memory_s
        for request_id, (heard_at, _) in list(self.heard.items()):
            if heard_at < horizon:
                del self.heard[request_id]
        return [(request_id, below) for request_id, (_, below) in self.heard.items()]

    async def run(self) -> None:
        """Background: listen; resubscribe with backoff after a Redis outage, and on the new
        master once the sentinels name one."""
        backoff = 0.25
        while True:
            pubsub = None
            try:
                pubsub = await pubsub_of(self.redis)
                seen = self.master.num_switches
                await pubsub.subscribe(self.channels.aborts)
                address = address_of(pubsub.connection)
                backoff = 0.25
                while True:
                    seen = self.master.check(seen, address)
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
                    if message is not None and message["type"] == "message":
                        self.hear(message["data"])
            except REDIS_ERRORS as exc:
                log.warning("abort channel lost (%s); resubscribing in %.2f s", exc, backoff)
                await self.master.pause(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(*REDIS_ERRORS):
                        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # redis<8.2

    def hear(self, data: bytes) -> None:
        try:
            abort = decode(data, AbortRequest)
        except Exception as exc:  # a poisoned message must not stop the listener
            log.warning("malformed abort message: %s", exc)
            return
        below = abort.below_attempt
        earlier = self.heard.get(abort.request_id)
        if earlier is not None and (earlier[1] == 0 or (below and earlier[1] > below)):
            below = earlier[1]  # what was heard covers more
        self.heard[abort.request_id] = (time.time(), below)
