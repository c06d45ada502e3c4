"""Resuming a request whose token events can no longer reach this gateway.

The gateway is the recovery authority (../shared/reference/redis-ha.md): it holds the client's
connection, the request and the tokens delivered. When the reply subscription is lost (Redis
restarted, failed over or was unreachable) or tokens arrive past a gap, the router sends the
request a RESUME event (services/gateway/pipeline/replies.py). The request then waits for the
subscription to come back and adds itself to its lane again, under the same request_id, with
the tokens it delivered as `generated_ids`, as a worker group's failover does: the group that
takes it continues at the next index, and since a draw depends only on (seed, token index),
the continuation equals the undisturbed output. Each re-submission carries the next `attempt`:
a scheduler that holds an earlier one replaces it, and an abort of the earlier attempts stops
copies that survived elsewhere (meanwhile the router delivers each index once). It gives up (a
generation error) after --redis-resume-timeout or at the request's deadline.

    delivered 1..7 | RESUME | (Redis back) XADD generated_ids=[t1..t7] | tokens 8, 9, ...
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec

from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline.errors import GatewayError, generation_failed
from services.gateway.pipeline.replies import LOST_CONNECTION, ReplyRouter
from services.gateway.pipeline.results import KeepAlive
from shared.messages import GenerateRequest

log = logging.getLogger(__name__)
MAX_RETRY_S = 0.5  # the longest wait between two tries


class Resumer:
    def __init__(
        self,
        send: Callable[[GenerateRequest], Awaitable[None]],
        abort: Callable[[str, str, int], None],
        router: ReplyRouter,
        metrics: GatewayMetrics,
        timeout_s: float,
    ) -> None:
        self.send = send  # adds a request to its lane (Generator._send)
        self.abort = abort  # publishes an AbortRequest (Generator._abort)
        self.router = router
        self.metrics = metrics
        self.timeout_s = timeout_s  # --redis-resume-timeout

    async def resume(
        self, message: GenerateRequest, delivered: list[int], keepalive_s: float | None
    ) -> AsyncIterator[KeepAlive]:
        """Re-submit `message` continuing after `delivered`, once Redis answers; KeepAlive
        every `keepalive_s` meanwhile. Raises a generation error when it cannot in time."""
        started = time.monotonic()
        give_up_at = min(message.deadline, time.time() + self.timeout_s)
        attempt = max(self.router.attempt(message.request_id), message.attempt) + 1
        resumed = msgspec.structs.replace(message, generated_ids=list(delivered), attempt=attempt)
        delay, beat_at, last_error = 0.05, started, LOST_CONNECTION
        while True:
            if self.router.is_subscribed:
                try:
                    await self.send(resumed)
                except GatewayError as exc:  # unreachable or full: try again
                    last_error = exc.message
                else:
                    self.router.resumed(message.request_id, attempt)
                    # earlier copies that survived stop now, wherever they run
                    self.abort(message.request_id, "resumed", attempt)
                    self.metrics.num_resumed_requests += 1
                    log.info(
                        "request %s resumed after %d tokens (%.2f s without Redis)",
                        message.request_id,
                        len(delivered),
                        time.monotonic() - started,
                    )
                    return
            if time.time() >= give_up_at:
                log.warning("request %s could not resume: %s", message.request_id, last_error)
                raise generation_failed(f"{LOST_CONNECTION}: {last_error}", "generation")
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_S)
            if keepalive_s is not None and time.monotonic() - beat_at >= keepalive_s:
                beat_at = time.monotonic()
                yield KeepAlive()
