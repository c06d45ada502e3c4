"""Token events from workers to the request that waits for them.

The gateway subscribes ONCE, at start-up, to its own reply channel
`{textgen}:reply:<gateway_id>`; workers PUBLISH one ReplyBatch per step with every token event
for this gateway. The router puts each TokenEvent on the asyncio.Queue registered for its
request_id. Events of unknown requests (finished, aborted, another gateway's) are dropped, and
so are token indexes already delivered: a request replayed on another worker group re-sends its
first tokens, and the client must still see one unbroken stream. Only contiguous indexes are
delivered: an event that starts past the next index (its predecessor was published while this
gateway was not listening) is dropped, and the request is told to resume.

When the subscription is lost (Redis went away or failed over, or the sentinels named a new
master while the old primary still answers: shared/master_watch.py), or a Redis Cluster's node
failed over (the subscription stays), every registered request is told to resume (a RESUME
event; services/gateway/pipeline/generation.py re-submits it with the tokens it delivered once
Redis answers again), since a token published meanwhile never reaches this gateway; with
resuming off (`--redis-resume-timeout 0`) each gets an error event at once instead. A malformed
ReplyBatch is logged and skipped.

    delivered 1..7    event 8..9  -> delivered          event 11 -> dropped, RESUME (gap at 10)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import redis.asyncio as aioredis

from shared.bus import REDIS_FAILURES
from shared.codec import decode
from shared.master_watch import MasterWatch, address_of
from shared.messages import SCHEMA_VERSION, ReplyBatch, TokenEvent
from shared.redis_connect import pubsub_of

log = logging.getLogger(__name__)
LOST_CONNECTION = "lost the connection to Redis"
RESUME = "resume"  # error_type of the event that tells a request to re-submit itself
MAX_BACKOFF_S = 1.0  # a failover takes seconds: retry often enough to follow it


@dataclass
class _Pending:
    queue: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    num_delivered: int = 0  # highest token index handed to the queue
    is_resuming: bool = False  # told to resume and not re-submitted yet (one RESUME at a time)
    attempt: int = 0  # last re-submitted as (0: never): earlier attempts' gaps ask no RESUME


def without_duplicates(event: TokenEvent, num_delivered: int) -> TokenEvent | None:
    """The part of `event` after token index `num_delivered`; None when nothing is new."""
    if event.error or not event.token_ids:
        return event
    first_index = event.index or num_delivered + 1
    num_old = num_delivered - first_index + 1
    if num_old <= 0:
        return event
    if num_old >= len(event.token_ids):
        if event.finish_reason is None:
            return None
        num_old = len(event.token_ids)
    return msgspec.structs.replace(
        event,
        index=first_index + num_old,
        token_ids=event.token_ids[num_old:],
        logprobs=event.logprobs[num_old:],
        top_tokens=event.top_tokens[num_old:],
    )


class ReplyRouter:
    """Owns the gateway's single reply subscription and the per-request queues."""

    def __init__(
        self,
        client: aioredis.Redis,
        channel: str,
        resume: bool = True,
        on_epoch_change: Callable[[], None] = lambda: None,
        master: MasterWatch | None = None,
        on_replaced_attempt_event: Callable[[], None] = lambda: None,
    ):
        self.client = client
        self.channel = channel
        # Redis's identity at the last subscription: (run_id, master_replid). A restart changes
        # the first, a failover the second: a suffix of its writes may be gone
        self.epoch: tuple[str, str] | None = None
        self.on_epoch_change = on_epoch_change
        # the sentinels' master: when they name another, the subscription (on the old primary,
        # which a graceful failover leaves up) is dropped and made again on the new one
        self.master = master or MasterWatch(None, "")
        self.resume = resume  # on a lost subscription, resume the requests (else fail them)
        self.num_resumes = 0  # RESUME events sent (lost subscriptions and gaps)
        # called per event of a replaced attempt dropped past a gap (its new attempt makes them)
        self.on_replaced_attempt_event = on_replaced_attempt_event
        self.is_subscribed = False
        self._pending: dict[str, _Pending] = {}
        self._task: asyncio.Task | None = None
        # stopped by flag, not by cancellation: cancelling a blocked redis-py read can hang
        self._is_stopping = False

    @property
    def num_registered(self) -> int:
        return len(self._pending)

    def register(self, request_id: str) -> asyncio.Queue[TokenEvent]:
        """Call BEFORE sending the request, so no event can arrive unheard."""
        pending = self._pending[request_id] = _Pending()
        return pending.queue

    def unregister(self, request_id: str) -> int:
        """Forget the request; the attempt it was last re-submitted as (0: never)."""
        pending = self._pending.pop(request_id, None)
        return pending.attempt if pending is not None else 0

    def attempt(self, request_id: str) -> int:
        """The attempt the request was last re-submitted as (0: never, or not registered)."""
        pending = self._pending.get(request_id)
        return pending.attempt if pending is not None else 0

    def resumed(self, request_id: str, attempt: int) -> None:
        """The request was re-submitted as `attempt`: a later loss or gap may resume it again,
        but a gap before late tokens of an earlier attempt is no loss (the new one makes the
        same tokens; contiguous ones are still delivered)."""
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.is_resuming = False
            pending.attempt = attempt

    def dispatch(self, batch: ReplyBatch) -> None:
        for event in batch.events:
            pending = self._pending.get(event.request_id)
            if pending is None:
                continue
            fresh = without_duplicates(event, pending.num_delivered)
            if fresh is None:
                continue
            if fresh.token_ids and fresh.index > pending.num_delivered + 1:
                if event.attempt < pending.attempt:  # a replaced attempt's: no loss
                    log.debug("%s: late tokens of attempt %d", event.request_id, event.attempt)
                    self.on_replaced_attempt_event()
                    continue
                log.info(
                    "request %s: tokens from index %d, %d expected: resuming",
                    event.request_id,
                    fresh.index,
                    pending.num_delivered + 1,
                )
                self._tell_resume(event.request_id, pending)
                continue
            if fresh.token_ids:
                pending.num_delivered = fresh.index + len(fresh.token_ids) - 1
            pending.queue.put_nowait(fresh)

    def _tell_resume(self, request_id: str, pending: _Pending) -> None:
        if pending.is_resuming:
            return
        pending.is_resuming = True
        self.num_resumes += 1
        pending.queue.put_nowait(
            TokenEvent(request_id=request_id, error=LOST_CONNECTION, error_type=RESUME)
        )

    def lose_all(self) -> None:
        """The subscription was lost: every registered request resumes (or fails, with
        resuming off)."""
        if not self.resume:
            self.fail_all(LOST_CONNECTION)
            return
        for request_id, pending in self._pending.items():
            self._tell_resume(request_id, pending)
        if self._pending:
            log.warning("%d requests in flight resume: %s", len(self._pending), LOST_CONNECTION)

    def fail_all(self, message: str) -> None:
        """End every registered request with an error event (the subscription was lost)."""
        for request_id, pending in self._pending.items():
            pending.queue.put_nowait(
                TokenEvent(request_id=request_id, error=message, error_type="generation")
            )
        if self._pending:
            log.warning("failed %d requests in flight: %s", len(self._pending), message)

    def on_message(self, data: bytes) -> None:
        """Dispatch one ReplyBatch; anything unreadable is logged and skipped, never raised."""
        try:
            batch = decode(data, ReplyBatch)
            if batch.v > SCHEMA_VERSION:
                log.warning(
                    "dropping reply batch of schema version %s (this gateway reads %s) on %s",
                    batch.v,
                    SCHEMA_VERSION,
                    self.channel,
                )
                return
            self.dispatch(batch)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("dropping malformed reply batch on %s: %s", self.channel, exc)
        except Exception:
            log.exception("dropping a reply batch that could not be dispatched on %s", self.channel)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reply-router")

    async def stop(self) -> None:
        self._is_stopping = True
        if self._task is not None:
            done, _ = await asyncio.wait([self._task], timeout=2.0)
            if not done:
                self._task.cancel()
        self.is_subscribed = False

    async def wait_subscribed(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.is_subscribed and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return self.is_subscribed

    async def _check_epoch(self) -> None:
        """Note Redis's identity; a change (a restart, a failover) is logged and counted."""
        try:
            server = await self.client.info("server")
            replication = await self.client.info("replication")
        except REDIS_FAILURES as exc:  # the subscription decides whether Redis is there
            log.debug("no Redis identity: %s", exc)
            return
        epoch = (str(server.get("run_id", "")), str(replication.get("master_replid", "")))
        if self.epoch is not None and epoch != self.epoch:
            log.warning(
                "Redis changed (run_id %s, replication id %s): requests in flight resume",
                epoch[0][:8],
                epoch[1][:8],
            )
            self.on_epoch_change()
        self.epoch = epoch

    async def _run(self) -> None:
        """Subscribe and listen forever; on a Redis failure, tell the requests in flight to
        resume and resubscribe with backoff (0.1 s doubling up to MAX_BACKOFF_S)."""
        delay = 0.1
        while not self._is_stopping:
            pubsub = None
            try:
                pubsub = await pubsub_of(self.client)
                seen = self.master.num_switches
                await pubsub.subscribe(self.channel)
                address = address_of(pubsub.connection)
                await self._check_epoch()
                self.is_subscribed = True
                delay = 0.1
                log.info("listening for token events on %s", self.channel)
                while not self._is_stopping:
                    if self.master.cluster and self.master.num_switches != seen:
                        # a cluster node failed over: an event it took may be lost, yet this
                        # subscription (on another node, or it had failed) still hears the rest
                        seen = self.master.num_switches
                        self.lose_all()
                    seen = self.master.check(seen, address)
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
                    if message is not None and message["type"] == "message":
                        self.on_message(message["data"])
            except Exception as exc:  # Redis errors, and anything else: the router never dies
                self.is_subscribed = False
                self.lose_all()
                if isinstance(exc, REDIS_FAILURES):
                    log.warning("reply subscription lost (%s); retrying in %.1fs", exc, delay)
                else:
                    log.exception("reply subscription failed; retrying in %.1fs", delay)
                await self.master.pause(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)
            finally:
                self.is_subscribed = False
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
