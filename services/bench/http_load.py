"""Concurrent /generate requests against a running server; tokens/s of the whole run."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from services.bench.workload import Case


@dataclass
class LoadResult:
    num_requests: int
    num_generated_tokens: int
    wall_s: float
    latencies_s: list[float]
    token_ids: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.wall_s


async def _one(client: httpx.AsyncClient, url: str, case: Case) -> tuple[float, list[int]]:
    started = time.perf_counter()
    response = await client.post(
        f"{url}/generate",
        json={
            "inputs": case.prompt,
            "parameters": {"max_new_tokens": case.max_new_tokens, "details": True},
        },
    )
    response.raise_for_status()
    ids = [t["id"] for t in response.json()["details"]["tokens"]]
    return time.perf_counter() - started, ids


async def run_load(url: str, cases: list[Case], timeout_s: float = 600.0) -> LoadResult:
    """Send every case at once and wait for all of them."""
    limits = httpx.Limits(max_connections=len(cases) + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, case) for case in cases))
        wall_s = time.perf_counter() - started
    return LoadResult(
        num_requests=len(cases),
        num_generated_tokens=sum(len(ids) for _, ids in results),
        wall_s=wall_s,
        latencies_s=[latency for latency, _ in results],
        token_ids=[ids for _, ids in results],
    )
