"""Running a service's asyncio main."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop's event loop where it is installed (its loop and transports cost
    a fraction of asyncio's per Redis message and socket write, CPU that the services share
    with the workers' forward passes on a CPU host), else on asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
