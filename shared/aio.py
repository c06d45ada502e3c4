"""Running a service's asyncio main, with its stacks on demand.

`kill -USR1 <pid>` writes every thread's stack and every asyncio task's to stderr (the
service's log): what a stuck service waits on, without a debugger. py-spy cannot see a
task's await chain on uvloop, nor a Python thread from outside on hosts that forbid ptrace.

The dump is a Python signal handler, which the main thread runs between two bytecodes: it
holds the GIL, so the other threads' frames stand still while it reads them. (faulthandler's
dump reads them from the C signal handler while they run: about one SIGUSR1 in 200 killed the
process with a segmentation fault.) A main thread inside one long C call that keeps the GIL
dumps when the call returns; a loop waiting for events is woken by the signal.

A stopped service's teardown is bounded (run): the tasks its main left running get
TEARDOWN_S to end once cancelled. A scheduler once logged "stopped" and then never exited,
its teardown waiting on a task that did not end (which one, its dump would now tell).
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


TEARDOWN_S = 5.0  # how long the tasks a finished main left running get to end once cancelled


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end on uvloop's event loop where it is installed (its loop and
    transports cost a fraction of asyncio's per Redis message and socket write, CPU that the
    services share with the workers' forward passes on a CPU host), else on asyncio's own,
    with SIGUSR1 dumping the threads' and tasks' stacks throughout, teardown included. Then
    the tasks main left running are cancelled and waited for, up to TEARDOWN_S (as are async
    generators and the default executor's threads): one that swallows its cancellation (as
    Python 3.11's wait_for can, or a library catching CancelledError) is logged with its
    stack and left behind, where asyncio.run would wait for it forever and a stopped service
    would never exit."""
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    try:
        previous = signal.signal(DUMP_SIGNAL, dump_stacks)
    except ValueError:  # not the main thread
        log.debug("no stack dumps on %s", DUMP_SIGNAL.name)
        previous = None
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            loop.run_until_complete(_end_leftovers())
        finally:
            if previous is not None:
                signal.signal(DUMP_SIGNAL, previous)
            asyncio.set_event_loop(None)
            loop.close()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _end_leftovers() -> None:
    loop = asyncio.get_running_loop()
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    done, pending = await asyncio.wait(tasks, timeout=TEARDOWN_S) if tasks else (set(), set())
    for task in done:
        if not task.cancelled() and (exception := task.exception()) is not None:
            message = "a task ended with an exception at teardown"
            loop.call_exception_handler({"message": message, "exception": exception, "task": task})
    for task in pending:
        stack = io.StringIO()
        task.print_stack(file=stack)
        log.warning(
            "task %r ignored its cancellation for %g s; left behind:\n%s",
            task.get_name(),
            TEARDOWN_S,
            stack.getvalue(),
        )
    for what, step in (
        ("async generators", loop.shutdown_asyncgens()),
        ("executor threads", loop.shutdown_default_executor()),
    ):
        try:
            await asyncio.wait_for(step, TEARDOWN_S)
        except TimeoutError:
            log.warning("%s still running after %g s; left behind", what, TEARDOWN_S)
