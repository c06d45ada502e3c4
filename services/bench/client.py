"""The load generators: streamed requests (/generate_stream, or /v1/completions: apis.py),
closed loop (a fixed number in flight) or open loop (sent at given times whatever is in
flight). Each request becomes a RequestRecord (services.bench.timeline); the caller turns
those into metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.bench.apis import Api
from services.bench.sse_client import HTTPError, StreamingClient
from services.bench.timeline import RequestRecord, parse_sse_line
from services.bench.workload import Case

TGI = Api()


@dataclass
class LevelRun:
    """One level of a sweep: every request's record and the level's wall time."""

    mode: str  # "concurrency" (closed loop) or "rate" (open loop, requests/s)
    value: float  # the concurrency or the request rate
    records: list[RequestRecord]  # in workload order
    wall_s: float  # first send to last answer
    # % of one core used during the level, per role (worker, gateway, ..., bench): cpu.py
    cpu_pct: dict[str, float] = field(default_factory=dict)


async def stream_one(client: StreamingClient, case: Case, api: Api) -> RequestRecord:
    """Send one request and timestamp every event as it arrives; never raises. The events'
    JSON is decoded by `decode_events` once the level is over: the bench shares the CPU with
    the server it measures."""
    record = RequestRecord(sent_at=time.perf_counter())

    def on_line(line: bytes, at: float) -> None:
        if line.startswith(b"data:"):
            record.raw_events.append((line, at))

    try:
        status, error_body = await client.post_stream(api.path, api.body(case), on_line)
        if status != 200:
            record.error = f"HTTP {status}: {error_body.decode(errors='replace')[:200]}"
    except (TimeoutError, HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.done_at = time.perf_counter()
    return record


def decode_events(records: list[RequestRecord], api: Api) -> None:
    """Turn each record's raw `data:` lines into its events (an error event marks it failed)."""
    for record in records:
        for line, at in record.raw_events:
            payload = parse_sse_line(line.decode())
            if payload is not None:
                api.record(record, payload, at)
        record.raw_events.clear()


async def run_closed_loop(
    url: str,
    cases: list[Case],
    concurrency: int,
    on_done: Callable[[], None] = lambda: None,
    timeout_s: float = 600.0,
    api: Api = TGI,
) -> LevelRun:
    """Keep `concurrency` requests in flight until every case is answered: each of
    `concurrency` senders takes the next case as soon as its previous one ends."""
    records: list[RequestRecord | None] = [None] * len(cases)
    next_index = iter(range(len(cases)))

    async def sender() -> None:
        for i in next_index:  # shared iterator: asyncio runs one sender at a time
            records[i] = await stream_one(client, cases[i], api)
            on_done()

    client = StreamingClient(url, timeout_s)
    try:
        started = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(min(concurrency, len(cases)))))
        wall_s = time.perf_counter() - started
    finally:
        client.close()
    done = [r for r in records if r is not None]
    decode_events(done, api)
    return LevelRun("concurrency", concurrency, done, wall_s)


async def run_open_loop(
    url: str,
    cases: list[Case],
    rate: float,
    send_times: list[float],
    on_done: Callable[[], None] = lambda: None,
    timeout_s: float = 600.0,
    api: Api = TGI,
) -> LevelRun:
    """Send case i at `send_times[i]` seconds after the start (Poisson arrivals from
    services.bench.arrivals), however many are still in flight."""

    async def timed(case: Case, at: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        record = await stream_one(client, case, api)
        on_done()
        return record

    client = StreamingClient(url, timeout_s)
    try:
        started = time.perf_counter()
        records = await asyncio.gather(
            *(timed(case, at) for case, at in zip(cases, send_times, strict=True))
        )
        wall_s = time.perf_counter() - started
    finally:
        client.close()
    decode_events(list(records), api)
    return LevelRun("rate", rate, list(records), wall_s)
