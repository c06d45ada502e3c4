"""The load generators: streamed /generate_stream requests, closed loop (a fixed number in
flight) or open loop (sent at given times whatever is in flight). Each request becomes a
RequestRecord (services.bench.timeline); the caller turns those into metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from services.bench.timeline import RequestRecord, parse_sse_line, record_event
from services.bench.workload import Case


@dataclass
class LevelRun:
    """One level of a sweep: every request's record and the level's wall time."""

    mode: str  # "concurrency" (closed loop) or "rate" (open loop, requests/s)
    value: float  # the concurrency or the request rate
    records: list[RequestRecord]  # in workload order
    wall_s: float  # first send to last answer
    # % of one core used during the level, per role (worker, gateway, ..., bench): cpu.py
    cpu_pct: dict[str, float] = field(default_factory=dict)


def body(case: Case) -> dict:
    """A greedy TGI request; details for the token count of the final event."""
    return {
        "inputs": case.prompt,
        "parameters": {"max_new_tokens": case.max_new_tokens, "details": True},
    }


async def stream_one(client: httpx.AsyncClient, url: str, case: Case) -> RequestRecord:
    """Send one request and timestamp every event as it arrives; never raises."""
    record = RequestRecord(sent_at=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/generate_stream", json=body(case)) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return record
            async for line in response.aiter_lines():
                payload = parse_sse_line(line)
                if payload is not None:
                    record_event(record, payload, time.perf_counter())
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.done_at = time.perf_counter()
    return record


def _client(max_connections: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections + 4, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=timeout_s, limits=limits)


async def run_closed_loop(
    url: str,
    cases: list[Case],
    concurrency: int,
    on_done: Callable[[], None] = lambda: None,
    timeout_s: float = 600.0,
) -> LevelRun:
    """Keep `concurrency` requests in flight until every case is answered: each of
    `concurrency` senders takes the next case as soon as its previous one ends."""
    records: list[RequestRecord | None] = [None] * len(cases)
    next_index = iter(range(len(cases)))

    async def sender(client: httpx.AsyncClient) -> None:
        for i in next_index:  # shared iterator: asyncio runs one sender at a time
            records[i] = await stream_one(client, url, cases[i])
            on_done()

    async with _client(concurrency, timeout_s) as client:
        started = time.perf_counter()
        await asyncio.gather(*(sender(client) for _ in range(min(concurrency, len(cases)))))
        wall_s = time.perf_counter() - started
    return LevelRun("concurrency", concurrency, [r for r in records if r is not None], wall_s)


async def run_open_loop(
    url: str,
    cases: list[Case],
    rate: float,
    send_times: list[float],
    on_done: Callable[[], None] = lambda: None,
    timeout_s: float = 600.0,
) -> LevelRun:
    """Send case i at `send_times[i]` seconds after the start (Poisson arrivals from
    services.bench.arrivals), however many are still in flight."""

    async def timed(client: httpx.AsyncClient, case: Case, at: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        record = await stream_one(client, url, case)
        on_done()
        return record

    async with _client(len(cases), timeout_s) as client:
        started = time.perf_counter()
        records = await asyncio.gather(
            *(timed(client, case, at) for case, at in zip(cases, send_times, strict=True))
        )
        wall_s = time.perf_counter() - started
    return LevelRun("rate", rate, list(records), wall_s)
