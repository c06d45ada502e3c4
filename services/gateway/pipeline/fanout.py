"""Running several generations of one request at once (best_of, n, several prompts).

`merge` interleaves their streams in arrival order, `gather_or_fail` waits for all of them;
in both the first error ends the request and cancels the others (their aborts go out and
their slots come back before the answer does).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar, cast

from services.gateway.pipeline.errors import incomplete_generation
from services.gateway.pipeline.results import Finished, KeepAlive, Token

T = TypeVar("T")
Item = Token | Finished | KeepAlive
_END = object()  # a merged stream is over


async def merge(
    streams: list[AsyncIterator[Item]], keepalive_s: float
) -> AsyncIterator[tuple[int, Item]]:
    """(stream index, item) from every stream as items come; KeepAlive after `keepalive_s`
    of silence. The first exception cancels the other streams and is raised."""
    if len(streams) == 1:  # the common case: no task, no queue
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Item]) -> None:
        try:
            async for item in stream:
                if not isinstance(item, KeepAlive):
                    queue.put_nowait((index, item))
        except Exception as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, _END))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    num_running = len(tasks)
    try:
        while num_running:
            try:
                got: tuple[int, object] = await asyncio.wait_for(queue.get(), keepalive_s)
            except TimeoutError:
                yield 0, KeepAlive()
                continue
            index, entry = got
            if entry is _END:
                num_running -= 1
            elif isinstance(entry, Exception):
                raise entry
            else:
                yield index, cast(Item, entry)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)  # their aborts are sent before the answer ends


async def collect(items: AsyncIterator[Item]) -> tuple[list[Token], Finished]:
    """A generation's tokens and its end."""
    tokens: list[Token] = []
    async for item in items:
        if isinstance(item, Token):
            tokens.append(item)
        elif isinstance(item, Finished):
            return tokens + ([item.last_token] if item.last_token else []), item
    raise incomplete_generation()


async def gather_or_fail(works: Sequence[Awaitable[T]]) -> list[T]:
    """All results in order; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failures = [t.exception() for t in tasks if t.done() and not t.cancelled()]
        first = next((exc for exc in failures if exc is not None), None)
        if first is not None:
            raise first
        return [task.result() for task in tasks]
    finally:
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:  # let them release their slots and send their aborts before answering
            await asyncio.wait(pending)
