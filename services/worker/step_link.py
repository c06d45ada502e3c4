"""The torch thread's own line to Redis: the next step plans in, each step's output out.

The worker does a step's Redis work on the thread that computes it (services/worker/service.py)
so that no other Python thread takes the GIL while a forward pass runs. Neither direction waits
for Redis between two steps:

- in: one XREAD BLOCK on the steps stream is always out, so the next plan lands in the socket
  while the step before it computes and is only parsed when that step ends;
- out: a step's PUBLISHes and XADD leave in one write; their replies are read later, those
  already arrived before each write (an error reply is logged and counted). A write that a
  demoted primary refused (READONLY: Sentinel made it a replica; MOVED: a Redis Cluster moved
  the group's slot; CLUSTERDOWN: it fails a node over) is not lost: both connections are
  dropped, the next write reconnects to the master the sentinels name (or the node serving the
  slot) and sends that batch again first (a result or event twice is harmless: the scheduler
  keys results by step, the gateway delivers each token index once). A read the server ended
  because it was demoted (UNBLOCKED) or that a cluster answered MOVED or CLUSTERDOWN raises a
  ConnectionError, and the retry reconnects.
- a new master named by the sentinels (shared/master_watch.py; a graceful failover leaves the
  old primary up and writable for seconds): the next read or write closes both connections
  and raises MasterMoved, and the caller's retry reaches the new master.

Two connections, since a connection blocked in XREAD runs nothing else. Plain redis-py
connections (send a command now, read its reply later), with hiredis parsing where installed.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.exceptions import ClusterDownError, MovedError, ReadOnlyError, ResponseError

from shared.bus import REDIS_ERRORS, pairs_to_fields
from shared.master_watch import MasterMoved, MasterWatch, address_of
from shared.messages import StepPlan
from shared.redis_connect import DemotedWhileBlocked, sync_pool

log = logging.getLogger(__name__)

BLOCK_MS = 250  # how long one XREAD waits for a plan; stopping is checked in between
STOPPING_BLOCK_MS = 250  # the same once the worker is stopping (it ends at the first empty one)
SOCKET_TIMEOUT_S = 10.0  # a Redis that stops answering (not closing) surfaces as TimeoutError
MAX_UNANSWERED = 256  # commands sent and not yet answered before a write waits for replies
TRIM_EVERY = 64  # plans read between two trims of the steps stream

# what a server that is up but no longer serves the group's keys answers (a failover demoted it,
# or a Redis Cluster moved the slot or is failing a node over)
MOVED_ERRORS = (DemotedWhileBlocked, MovedError, ClusterDownError)
Command = Sequence[str | bytes | int]
Entry = tuple[bytes, dict[bytes, bytes]]  # (entry id, fields)


def xadd(stream: str, fields: Mapping[Any, Any], maxlen: int) -> Command:
    """XADD `stream` MAXLEN ~ `maxlen` * `fields`, for `StepLink.send`."""
    return (
        "XADD",
        stream,
        "MAXLEN",
        "~",
        maxlen,
        "*",
        *(x for pair in fields.items() for x in pair),
    )


class StepLink:
    """Plans in from `steps`, commands out, for one thread. Redis errors (REDIS_ERRORS in
    shared.bus) propagate; the next call reconnects."""

    def __init__(
        self,
        url: str | None,
        steps: str,
        on_error_reply: Callable[[], object] | None = None,
        sentinels: str | None = None,
        sentinel_master: str = "mymaster",
        master: MasterWatch | None = None,
        cluster: bool = False,
    ) -> None:
        """To `url`, or with `sentinels` to the master they name (each reconnect asks them), or
        with `cluster` to the node of the Redis Cluster that serves `steps` (its group's keys
        share that node: shared/channels.py)."""
        pool = sync_pool(
            url,
            sentinels,
            sentinel_master,
            cluster_key=steps if cluster else None,
            socket_connect_timeout=5,
            socket_timeout=SOCKET_TIMEOUT_S,
        )
        self._master = master or MasterWatch(None, "")  # read from this thread: an int
        self._master.follow(pool)  # it connects where the watch saw the master last
        self._reader = pool.make_connection()
        self._sender = pool.make_connection()
        self.steps = steps
        self.last_id = b"0-0"  # the last entry read from `steps`
        self._is_reading = False  # an XREAD is out on the reader, its reply not read yet
        self._num_unanswered = 0  # commands sent on the sender whose replies are unread
        # the batches those belong to, oldest first: [commands, replies unread, refused]
        self._batches: deque[list[Any]] = deque()
        self._refused: list[Command] = []  # a demoted primary's refusals, to send again
        self._is_demoted = False  # a refusal was read: reconnect before the next write
        self._num_untrimmed = 0  # entries read since the steps stream was last trimmed
        self._on_error_reply = on_error_reply
        self._master_seen = self._master.num_switches  # its switches when last connected

    def has_arrived(self) -> bool:
        """Whether the reply to the XREAD that is out has arrived (reading it will not wait)."""
        try:
            return self._is_reading and self._reader.can_read(0)
        except REDIS_ERRORS:  # read() meets the error again, and reconnects
            return False

    def read(self, block_ms: int = BLOCK_MS) -> list[Entry]:
        """The entries after the last one read: those already there, else the first to arrive
        within the XREAD's block time (an empty list when none did). The next XREAD is out
        before this returns."""
        self._follow_master()
        try:
            self._flush_refused()
            if not self._is_reading:
                self._send_read(block_ms)
            reply = self._reader.read_response()
        except BaseException as exc:
            self._reader.disconnect()  # the XREAD out, if any, is abandoned with it
            # the same server: the sender's connection is as dead, and a write into a socket
            # the server closed can seem to succeed (its loss shows only at the next write)
            self._sender.disconnect()
            if not isinstance(exc, MOVED_ERRORS):
                self._forget_unanswered()
                raise
            # the server is up but no longer serves the group's keys: what it left unanswered
            # may have been refused, so it is sent again where they are now (twice is harmless)
            self._refused = [*self._refused, *(c for batch in self._batches for c in batch[0])]
            self._forget_unanswered()
            if isinstance(exc, DemotedWhileBlocked):
                raise
            raise ConnectionError(f"Redis Cluster: {exc}") from exc
        finally:
            self._is_reading = False
        # RESP3 answers {stream: entries}, RESP2 [[stream, entries]]; None when none came
        per_stream = reply.values() if isinstance(reply, dict) else [e for _, e in reply or []]
        entries = [
            (entry_id, pairs_to_fields(pairs)) for found in per_stream for entry_id, pairs in found
        ]
        if entries:
            self.last_id = entries[-1][0]
        self._num_untrimmed += len(entries)
        with contextlib.suppress(*REDIS_ERRORS):  # the entries are read; the next call retries
            self._send_read(block_ms)
            # every TRIM_EVERY plans, and once idle (an idle group leaves an empty stream)
            if self._num_untrimmed >= TRIM_EVERY or (self._num_untrimmed and not entries):
                self.send([("XTRIM", self.steps, "MINID", "~", self.last_id)])
                self._num_untrimmed = 0
        return entries

    def send(self, commands: list[Command]) -> None:
        """Write `commands` in one packet (after any a demoted primary refused); their replies
        are read by a later call."""
        self._follow_master()
        try:
            self._drain()
            if self._is_demoted:
                self._is_demoted = False
                self.close()  # both reconnect to the master the sentinels name now
                raise ConnectionError("the Redis primary became a replica (READONLY)")
            batch = [*self._refused, *commands]
            self._sender.send_packed_command(self._sender.pack_commands(batch))
        except BaseException:
            self._forget_unanswered()  # their replies went with the connection
            self._sender.disconnect()
            raise
        self._refused = []
        self._num_unanswered += len(batch)
        self._batches.append([batch, len(batch), False])

    def _follow_master(self) -> None:
        """Raise MasterMoved, with both connections closed, once the sentinels named another
        master than the one the reader is on: what was sent since is the old primary's, as
        after a lost connection."""
        if getattr(self._reader, "_sock", None) is None:  # it connects to the current master
            self._master_seen = self._master.num_switches
            return
        try:
            self._master_seen = self._master.check(self._master_seen, address_of(self._reader))
        except MasterMoved:
            self._master_seen = self._master.num_switches
            self.close()
            self._forget_unanswered()
            raise

    def _flush_refused(self) -> None:
        """Send again at once what was refused or left unanswered by a server that no longer
        serves the group's keys: the scheduler waits for those results before it plans more,
        so the next step's write may never come."""
        if self._num_unanswered and self._sender.can_read(0):
            self._drain()
        if self._is_demoted or self._refused:
            self.send([])  # after a demotion it reconnects first (raising once)

    def _forget_unanswered(self) -> None:
        self._num_unanswered = 0
        self._batches.clear()

    def close(self) -> None:
        """Both connections closed (the next call reconnects); the XREAD out goes with them."""
        for connection in (self._reader, self._sender):
            connection.disconnect()
        self._is_reading = False

    def _send_read(self, block_ms: int) -> None:
        self._reader.send_command("XREAD", "BLOCK", block_ms, "STREAMS", self.steps, self.last_id)
        self._is_reading = True

    def _drain(self) -> None:
        """Read the replies that have arrived; past MAX_UNANSWERED, wait for them. With none
        due, a readable socket is one the server closed: reading it raises, so the write is
        not lost in a dead socket (a Redis restarted while this thread computed)."""
        while self._num_unanswered and (
            self._num_unanswered >= MAX_UNANSWERED or self._sender.can_read(0)
        ):
            batch = self._batches[0]
            try:
                self._sender.read_response()
            except ResponseError as exc:
                # a demoted primary, or a cluster node that no longer serves the group's slot
                if isinstance(exc, (ReadOnlyError, *MOVED_ERRORS)):
                    batch[2] = True  # sent again once reconnected to the master
                else:
                    log.error("Redis refused a worker's write: %s", exc)
                if self._on_error_reply is not None:
                    self._on_error_reply()
            self._num_unanswered -= 1
            batch[1] -= 1
            if not batch[1]:
                self._batches.popleft()
                if batch[2]:
                    log.warning("the Redis primary refused a step's output: sending it again")
                    self._refused = [*self._refused, *batch[0]]
                    self._is_demoted = True
        if not self._num_unanswered and self._sender.can_read(0):
            self._sender.read_response()  # raises ConnectionError at the closed end


def skip_ended_sessions(plans: deque[StepPlan]) -> int:
    """Drop the plans queued before the last reset plan and return how many: their scheduler
    session ended (a Redis failure), the reset drops every request they would step, and the
    new session drops their results by its tag."""
    last_reset = max((i for i, plan in enumerate(plans) if plan.reset), default=0)
    for _ in range(last_reset):
        plans.popleft()
    return last_reset
