"""Running a service's asyncio main, with its stacks on demand.

`kill -USR1 <pid>` writes every thread's stack and every asyncio task's to stderr (the
service's log): what a stuck service waits on, without a debugger. py-spy cannot see a
task's await chain on uvloop, nor a Python thread from outside on hosts that forbid ptrace.

The dump is a Python signal handler, which the main thread runs between two bytecodes: it
holds the GIL, so the other threads' frames stand still while it reads them. (faulthandler's
dump reads them from the C signal handler while they run: about one SIGUSR1 in 200 killed the
process with a segmentation fault.) A main thread inside one long C call that keeps the GIL
dumps when the call returns; a loop waiting for events is woken by the signal.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Coroutine
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)
DUMP_SIGNAL = signal.SIGUSR1  # the signal that dumps the stacks


def format_stacks(interrupted: FrameType | None = None) -> str:
    """Every thread's stack, then every task's of the loop running in this thread (if any).
    This thread's stack ends at `interrupted` where given (a signal handler's frame)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sys._current_frames()
    if interrupted is not None:
        frames[threading.get_ident()] = interrupted
    out = io.StringIO()
    for ident, frame in frames.items():
        name = names.get(ident, "not a threading.Thread")
        out.write(f"Thread {ident:#x} {name!r} (most recent call last):\n")
        traceback.print_stack(frame, file=out)
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no loop runs in this thread
        tasks = set()
    for task in tasks:
        task.print_stack(file=out)
    return out.getvalue()


def dump_stacks(signum: int = DUMP_SIGNAL, frame: FrameType | None = None) -> None:
    """The signal handler: format_stacks() to stderr's file descriptor in one go (not through
    sys.stderr, which the interrupted code may be writing to). It never raises into the code
    it interrupted."""
    try:
        data = format_stacks(frame).encode(errors="replace")
        while data:
            data = data[os.write(sys.stderr.fileno(), data) :]
    except Exception:  # a closed stderr, say: the dump is lost, the service goes on
        log.warning("the stack dump failed", exc_info=True)


async def _with_stack_dumps(main: Coroutine[Any, Any, T]) -> T:
    try:
        previous = signal.signal(DUMP_SIGNAL, dump_stacks)
    except ValueError:  # not the main thread
        log.debug("no stack dumps on %s", DUMP_SIGNAL.name)
        return await main
    try:
        return await main
    finally:
        signal.signal(DUMP_SIGNAL, previous)


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
