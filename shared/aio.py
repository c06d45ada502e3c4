"""Running a service's asyncio main, with its stacks on demand.

`kill -USR1 <pid>` writes every thread's stack and every asyncio task's to stderr (the
service's log): what a stuck service waits on, without a debugger. py-spy cannot see a
task's await chain on uvloop, nor a Python thread from outside on hosts that forbid ptrace.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TextIO, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)
DUMP_SIGNAL = signal.SIGUSR1  # the signal that dumps the stacks


def dump_tasks(out: TextIO | None = None) -> int:
    """Write the stack of each task of the running loop to `out` (stderr); their number."""
    out = out or sys.stderr
    tasks = asyncio.all_tasks()
    for task in tasks:
        task.print_stack(file=out)
    out.flush()
    return len(tasks)


async def _with_stack_dumps(main: Coroutine[Any, Any, T]) -> T:
    loop = asyncio.get_running_loop()
    try:  # the tasks, from the loop (so not while it is blocked: the threads show that)
        loop.add_signal_handler(DUMP_SIGNAL, dump_tasks)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
        log.debug("no task dumps on %s", DUMP_SIGNAL.name)
    # the threads, at once from the signal handler, which then calls the loop's
    faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=True)
    try:
        return await main
    finally:
        faulthandler.unregister(DUMP_SIGNAL)


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop's event loop where it is installed (its loop and transports cost
    a fraction of asyncio's per Redis message and socket write, CPU that the services share
    with the workers' forward passes on a CPU host), else on asyncio's own. SIGUSR1 dumps the
    threads' and tasks' stacks."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_with_stack_dumps(main))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_with_stack_dumps(main))
