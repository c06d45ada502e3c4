"""A finished main's teardown (shared/aio.py run): the tasks it left running are cancelled and
waited for, so their cleanup runs, but one that swallows its cancellation is logged with its
stack and left behind after TEARDOWN_S instead of holding the process forever (asyncio.run
waits for it without end); on uvloop and on asyncio's own loop."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.cluster import REPO

SERVICE = """
import asyncio, logging, sys
if sys.argv[1] == "asyncio":
    sys.modules["uvloop"] = None  # shared.aio falls back on asyncio's loop
from shared import aio
aio.TEARDOWN_S = 0.5
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

async def stubborn():  # a library that catches CancelledError and goes on
    while True:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass

async def tidy():
    try:
        await asyncio.sleep(30)
    finally:
        print("tidied", flush=True)

async def failing():
    try:
        await asyncio.sleep(30)
    finally:
        raise RuntimeError("failed in its cleanup")

async def main():
    names = sys.argv[2].split(",")
    for name in names:
        asyncio.create_task(globals()[name](), name=name)
    await asyncio.sleep(0.1)
    return "done"

print("result", aio.run(main()), flush=True)
"""


def run_service(loop: str, tasks: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SERVICE, loop, tasks],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_task_that_swallows_its_cancellation_is_left_behind_with_its_stack(loop):
    done = run_service(loop, "stubborn,tidy")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["tidied", "result done"]  # cleanup ran, then main's
    assert "task 'stubborn' ignored its cancellation for 0.5 s; left behind" in done.stderr
    assert "in stubborn" in done.stderr  # where it was


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_tasks_that_end_on_cancellation_leave_no_warning(loop):
    done = run_service(loop, "tidy,failing")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["tidied", "result done"]
    assert "ignored its cancellation" not in done.stderr
    # an exception in a cancelled task's cleanup is reported, as asyncio.run reports it
    assert "failed in its cleanup" in done.stderr
