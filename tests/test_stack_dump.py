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


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_sigusr1_dumps_threads_and_tasks_and_the_service_goes_on(loop):
    child = subprocess.Popen(
        [sys.executable, "-c", SERVICE, loop],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGUSR1)
        assert child.stderr is not None
        dump = []
        while not dump or "name='heartbeat'" not in dump[-1]:  # the tasks come last
            dump.append(child.stderr.readline())
            assert dump[-1], "".join(dump)
        where = child.stderr.readline()  # the task's frame (in any order among the tasks)
        out, err = child.communicate("stop\n", timeout=30)  # it still serves
    finally:
        child.kill()
    assert child.returncode == 0 and out == "result stop\n", err
    assert "in compute" in "".join(dump)  # the thread, where it waits
    assert where.rstrip().endswith("in beat"), where  # the task, where it waits
