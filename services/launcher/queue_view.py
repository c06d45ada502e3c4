"""A read-only view of the queue and the worker groups, for `textgen queue`.

Everything comes from what the services already keep in Redis (see shared/channels.py):

    {textgen}:requests               stream of unfinished GenerateRequests; consumer group
                                     "schedulers" (consumer names are f"{group}-{hex}", one per
                                     scheduler session)
    {textgen}:groups                 set of worker group ids
    {textgen:group:<g>}:worker       WorkerReady (capacity)
    {textgen:group:<g>}:heartbeat    Heartbeat (expires when the group stops beating)
    {textgen:group:<g>}:scheduler    SchedulerStats (running, waiting, blocks, counters)
    {textgen:group:<g>}:drain        present while the group is told to drain

Only reading commands are sent (XLEN, XRANGE, XINFO, XPENDING, SMEMBERS, GET, EXISTS, TIME):
looking at the queue never changes it. Stream ids carry the Redis server's clock, so stream ages
are measured against Redis TIME; the `at` of heartbeats and stats is the sender's clock and is
compared with this machine's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis

from shared.bus import FIELD
from shared.channels import SCHEDULER_GROUP, Channels
from shared.codec import decode
from shared.messages import GenerateRequest, Heartbeat, SchedulerStats, WorkerReady

SCAN_PAGE = 200  # stream entries per XRANGE page when looking for one request


@dataclass
class StreamView:
    """The request stream and its consumer group."""

    key: str  # the stream's Redis key
    length: int  # entries: queued plus delivered-but-unfinished requests
    oldest_id: str | None  # id of the first entry (None: empty)
    oldest_age_s: float | None  # seconds since the first entry was added (None: empty)
    has_consumer_group: bool  # False until a scheduler created the group
    last_delivered_id: str | None  # the group's cursor: entries after it are not delivered yet
    entries_read: int | None  # entries the group ever read (Redis >= 7; None: unknown)
    lag: int | None  # entries not yet delivered, as Redis reports it (None: Redis cannot tell)
    num_pending: int  # delivered, not yet acknowledged: requests held by schedulers
    num_queued: int  # entries not delivered to any scheduler yet


@dataclass
class ConsumerView:
    """One scheduler session reading the stream (a restarted scheduler is a new consumer)."""

    name: str  # consumer name, f"{group}-{hex}"
    group: str  # worker group id (the name before its last '-')
    num_pending: int  # requests delivered to it and not acknowledged
    idle_s: float  # seconds since it last read or claimed


@dataclass
class GroupView:
    """One worker group: capacity from WorkerReady, liveness, and its scheduler's stats."""

    group: str  # worker group id
    model_id: str | None = None  # None: the worker never announced itself
    device: str | None = None
    world_size: int | None = None
    num_blocks: int | None = None  # KV-cache blocks (capacity)
    block_size: int | None = None  # tokens per block
    max_batch_size: int | None = None
    heartbeat_age_s: float | None = None  # None: no heartbeat (dead, or never started)
    is_last_step_ok: bool | None = None  # from the heartbeat
    stats_at: float | None = None  # unix s (scheduler's clock) of its last published stats
    stats_age_s: float | None = None  # seconds since the scheduler published its stats
    num_running: int | None = None
    num_waiting: int | None = None
    num_free_blocks: int | None = None
    num_used_blocks: int | None = None
    kv_use_pct: float | None = None  # used blocks / blocks, in percent
    num_steps: int | None = None
    num_finished: int | None = None
    num_preempted: int | None = None
    drain_requested: bool = False  # the drain key is set
    draining: bool = False  # the scheduler reports that it stopped pulling
    num_pending: int = 0  # requests pending for this group's consumers

    @property
    def is_alive(self) -> bool:
        return self.heartbeat_age_s is not None

    @property
    def state(self) -> str:
        """One word for the table."""
        if not self.is_alive:
            return "dead, drained" if self.drain_requested else "dead"
        if self.draining:
            return "draining"
        if self.drain_requested:
            return "draining?"  # asked; the scheduler has not confirmed yet
        return "ok" if self.is_last_step_ok is not False else "failing"


@dataclass
class QueueSnapshot:
    namespace: str
    at: float  # unix s (Redis server clock) of the snapshot
    stream: StreamView  # the normal lane (priority 0), in detail
    consumers: list[ConsumerView] = field(default_factory=list)
    groups: list[GroupView] = field(default_factory=list)
    lane_lengths: dict[str, int] = field(default_factory=dict)  # every lane's stream -> entries


@dataclass
class RequestState:
    """Where one request is. `state` is "queued", "assigned to <consumer>", "acknowledged" (ended,
    being removed) or "not in the stream (finished, aborted or unknown)"."""

    request_id: str
    state: str
    entry_id: str | None = None  # stream entry holding the request
    age_s: float | None = None  # seconds since the entry was added
    queue_position: int | None = None  # queued: undelivered entries ahead of it (0 = next)
    consumer: str | None = None  # assigned: the scheduler session holding it
    group: str | None = None  # assigned: its worker group
    idle_s: float | None = None  # assigned: seconds since it was delivered (or claimed)
    num_deliveries: int | None = None  # assigned: times it was delivered (> 1: claimed again)
    num_input_tokens: int | None = None
    num_generated_ids: int | None = None  # tokens carried over from an earlier group
    max_new_tokens: int | None = None
    priority: int | None = None


NOT_IN_STREAM = "not in the stream (finished, aborted or unknown)"


def stream_id(value: bytes | str) -> tuple[int, int]:
    """A stream id as a comparable (milliseconds, sequence) pair."""
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def group_of_consumer(name: str) -> str:
    """Worker group id of a consumer named f"{group}-{hex}" (group ids may contain '-')."""
    return name.rsplit("-", 1)[0] if "-" in name else name


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _info(raw: dict) -> dict[str, Any]:
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}


class QueueView:
    """Reads the queue state of one namespace; never writes."""

    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self.client = client
        self.namespace = namespace
        self.channels = Channels(namespace)

    def server_time(self) -> float:
        seconds, micros = self.client.time()
        return seconds + micros / 1e6

    def snapshot(self) -> QueueSnapshot:
        now = self.server_time()
        consumers = self._consumers()
        groups = self._groups(consumers)
        return QueueSnapshot(
            namespace=self.namespace,
            at=now,
            stream=self._stream(now, consumers),
            consumers=consumers,
            groups=groups,
            lane_lengths={lane: self.client.xlen(lane) for lane in self.channels.lanes},
        )

    def _group_info(self) -> dict[str, Any] | None:
        try:
            infos = self.client.xinfo_groups(self.channels.requests)
        except redis.ResponseError:  # no stream yet
            return None
        for raw in infos:
            info = _info(raw)
            if _text(info.get("name")) == SCHEDULER_GROUP:
                return info
        return None

    def _stream(self, now: float, consumers: list[ConsumerView]) -> StreamView:
        key = self.channels.requests
        length = self.client.xlen(key)
        first = self.client.xrange(key, count=1)
        oldest_id = _text(first[0][0]) if first else None
        oldest_age = None
        if oldest_id is not None:
            oldest_age = max(0.0, now - stream_id(oldest_id)[0] / 1000)
        info = self._group_info()
        num_pending = sum(c.num_pending for c in consumers)
        last_delivered = None
        entries_read = lag = None
        if info is not None:
            num_pending = int(info.get("pending") or 0)
            last_delivered = _text(info.get("last-delivered-id"))
            entries_read = info.get("entries-read")
            lag = info.get("lag")
        # the stream holds exactly the unfinished requests (acknowledged ones are deleted), so
        # what is not pending is queued; Redis' own lag is unknown once entries were deleted
        num_queued = max(0, length - num_pending)
        return StreamView(
            key=key,
            length=length,
            oldest_id=oldest_id,
            oldest_age_s=oldest_age,
            has_consumer_group=info is not None,
            last_delivered_id=last_delivered,
            entries_read=None if entries_read is None else int(entries_read),
            lag=None if lag is None else int(lag),
            num_pending=num_pending,
            num_queued=num_queued,
        )

    def _consumers(self) -> list[ConsumerView]:
        try:
            infos = self.client.xinfo_consumers(self.channels.requests, SCHEDULER_GROUP)
        except redis.ResponseError:  # no stream or no group yet
            return []
        consumers = []
        for raw in infos:
            info = _info(raw)
            name = _text(info["name"]) or ""
            consumers.append(
                ConsumerView(
                    name=name,
                    group=group_of_consumer(name),
                    num_pending=int(info.get("pending") or 0),
                    idle_s=int(info.get("idle") or 0) / 1000,
                )
            )
        return sorted(consumers, key=lambda c: c.name)

    def _groups(self, consumers: list[ConsumerView]) -> list[GroupView]:
        names = sorted(_text(g) or "" for g in self.client.smembers(self.channels.groups))
        if not names:
            return []
        pipe = self.client.pipeline(transaction=False)
        for group in names:
            pipe.get(self.channels.worker(group))
            pipe.get(self.channels.heartbeat(group))
            pipe.get(self.channels.scheduler_stats(group))
            pipe.exists(self.channels.drain(group))
        replies = pipe.execute()
        now = time.time()
        views = []
        for i, group in enumerate(names):
            ready_raw, beat_raw, stats_raw, drain = replies[4 * i : 4 * i + 4]
            view = GroupView(group=group, drain_requested=bool(drain))
            view.num_pending = sum(c.num_pending for c in consumers if c.group == group)
            if ready_raw is not None:
                ready = decode(ready_raw, WorkerReady)
                view.model_id, view.device = ready.model_id, ready.device
                view.world_size, view.num_blocks = ready.world_size, ready.num_blocks
                view.block_size, view.max_batch_size = ready.block_size, ready.max_batch_size
            if beat_raw is not None:
                beat = decode(beat_raw, Heartbeat)
                view.heartbeat_age_s = max(0.0, now - beat.at)
                view.is_last_step_ok = beat.is_last_step_ok
            if stats_raw is not None:
                _apply_stats(view, decode(stats_raw, SchedulerStats), now)
            views.append(view)
        return views

    def request_state(self, request_id: str) -> RequestState:
        """Find a request in the stream (paged XRANGE) and say whether it waits or who holds it."""
        key = self.channels.requests
        now = self.server_time()
        info = self._group_info()
        cursor = _text(info.get("last-delivered-id")) if info else None
        delivered_up_to = stream_id(cursor or "0-0")  # entries after it were never delivered
        num_queued_ahead = 0
        start = "-"
        while True:
            page: Any = self.client.xrange(key, min=start, count=SCAN_PAGE)
            for entry_id, fields in page:
                is_queued = stream_id(entry_id) > delivered_up_to
                try:
                    message = decode(fields[FIELD], GenerateRequest)
                except Exception:  # malformed entries are the scheduler's to drop
                    message = None
                if message is not None and message.request_id == request_id:
                    state = self._located(message, _text(entry_id) or "", is_queued, now)
                    state.queue_position = num_queued_ahead if is_queued else None
                    return state
                num_queued_ahead += is_queued
            if len(page) < SCAN_PAGE:
                return RequestState(request_id=request_id, state=NOT_IN_STREAM)
            start = "(" + (_text(page[-1][0]) or "")

    def _located(
        self, message: GenerateRequest, entry_id: str, is_queued: bool, now: float
    ) -> RequestState:
        state = RequestState(
            request_id=message.request_id,
            state="queued",
            entry_id=entry_id,
            age_s=max(0.0, now - stream_id(entry_id)[0] / 1000),
            num_input_tokens=len(message.input_ids),
            num_generated_ids=len(message.generated_ids),
            max_new_tokens=message.stopping.max_new_tokens,
            priority=message.priority,
        )
        if is_queued:
            return state
        pending: Any = self.client.xpending_range(
            self.channels.requests, SCHEDULER_GROUP, min=entry_id, max=entry_id, count=1
        )
        if not pending:
            state.state = "acknowledged"  # ended; the scheduler is deleting the entry
            return state
        consumer = _text(pending[0]["consumer"]) or ""
        state.state = f"assigned to {consumer}"
        state.consumer, state.group = consumer, group_of_consumer(consumer)
        state.idle_s = pending[0]["time_since_delivered"] / 1000
        state.num_deliveries = pending[0]["times_delivered"]
        return state


def _apply_stats(view: GroupView, stats: SchedulerStats, now: float) -> None:
    view.stats_at = stats.at
    view.stats_age_s = max(0.0, now - stats.at)
    view.num_running, view.num_waiting = stats.num_running, stats.num_waiting
    view.num_free_blocks = stats.num_free_blocks
    view.num_used_blocks = stats.num_blocks - stats.num_free_blocks
    if view.num_blocks is None:
        view.num_blocks = stats.num_blocks
    view.kv_use_pct = 100.0 * view.num_used_blocks / stats.num_blocks if stats.num_blocks else 0.0
    view.num_steps, view.num_finished = stats.num_steps, stats.num_finished
    view.num_preempted = stats.num_preempted
    view.draining = stats.draining
