"""SIGUSR1 on a service (shared/aio.py): every thread's stack and every asyncio task's go to
stderr, and the service goes on; on uvloop and on asyncio's own loop."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.support.cluster import REPO

SERVICE = """
import asyncio, sys, threading, time
if sys.argv[1] == "asyncio":
    sys.modules["uvloop"] = None  # shared.aio falls back on asyncio's loop
from shared.aio import run

def compute():  # a thread that is not the loop's, as the worker's torch thread
    time.sleep(30)

async def beat():
    await asyncio.sleep(30)

async def main():
    threading.Thread(target=compute, name="torch_0", daemon=True).start()
    task = asyncio.create_task(beat(), name="heartbeat")
    print("ready", flush=True)
    line = await asyncio.to_thread(sys.stdin.readline)  # the test's "stop"
    task.cancel()
    return line.strip()

print("result", run(main()), flush=True)
"""


def started(script: str, *args: str) -> subprocess.Popen:
    """`script` run by Python, once it printed "ready"."""
    child = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    return child


def dump_of(child: subprocess.Popen, last: str) -> list[str]:
    """SIGUSR1 to `child`: its stderr's lines up to the one holding `last`."""
    assert child.stderr is not None
    child.send_signal(signal.SIGUSR1)
    dump: list[str] = []
    while not dump or last not in dump[-1]:
        dump.append(child.stderr.readline())
        assert dump[-1], f"the service died ({child.wait(10)}): {''.join(dump)}"
    return dump


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_sigusr1_dumps_threads_and_tasks_and_the_service_goes_on(loop):
    child = started(SERVICE, loop)
    try:
        dump = dump_of(child, "name='heartbeat'")  # the tasks come last
        assert child.stderr is not None
        where = child.stderr.readline()  # the task's frame (in any order among the tasks)
        out, err = child.communicate("stop\n", timeout=30)  # it still serves
    finally:
        child.kill()
    assert child.returncode == 0 and out == "result stop\n", err
    assert "in compute" in "".join(dump)  # the thread, where it waits
    assert where.rstrip().endswith("in beat"), where  # the task, where it waits


CHURN = """
import asyncio, sys, threading
from shared.aio import run

def churn():  # threads that start, call and end without a pause: frames come and go
    def nest(depth):
        return 0 if depth == 0 else nest(depth - 1)
    while True:
        thread = threading.Thread(target=nest, args=(50,))
        thread.start()
        thread.join()

async def main():
    threading.Thread(target=churn, daemon=True).start()
    print("ready", flush=True)
    return (await asyncio.to_thread(sys.stdin.readline)).strip()

print("result", run(main()), flush=True)
"""


def test_dumps_while_threads_come_and_go_leave_the_service_up():
    """Stacks are read while other threads run, start and end: 100 dumps in a row, each
    whole, and the service still answers (faulthandler's dump, reading running threads'
    frames, died here within a few dozen)."""
    child = started(CHURN)
    try:
        for _ in range(100):
            dump_of(child, "name='Task-1'")  # the one task (main's) comes last
        out, err = child.communicate("stop\n", timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0 and out == "result stop\n", err
