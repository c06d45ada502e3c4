"""services.bench.cpu: /proc stat parsing, roles from command lines, the percentages, and a
live process tree."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from services.bench import cpu


def test_parse_stat_counts_fields_after_the_command_name():
    # a command name with spaces and a ')' inside; ppid 4321, utime 250, stime 50
    line = "1234 (python (x) y) S 4321 1234 1234 0 -1 4194304 10 0 0 0 250 50 0 0 20 0 3 0"
    assert cpu.parse_stat(line) == (4321, 300.0)


@pytest.mark.parametrize(
    ("cmdline", "role"),
    [
        ("/v/bin/python -m services.launcher.cli worker --model-id m --group g0", "worker"),
        ("/v/bin/python -m services.launcher.cli scheduler --model-id worker-model", "scheduler"),
        ("/v/bin/python -m services.launcher.cli gateway --port 3000", "gateway"),
        ("/usr/bin/redis-server 127.0.0.1:6379", "redis"),
        ("/v/bin/python -m services.launcher.cli launch --model-id m", "launcher"),
        ("/bin/sleep 5", "other"),
    ],
)
def test_role_of(cmdline, role):
    assert cpu.role_of(cmdline) == role


def test_percent_of_core():
    before = {"worker": 10.0, "gateway": 1.0, "bench": 2.0}
    after = {"worker": 25.0, "gateway": 1.5, "bench": 2.2, "late": 9.0}
    # 10 s of wall time: 15 s of worker CPU is 150% of one core; a role born meanwhile is left out
    used = cpu.percent_of_core(before, after, 10.0)
    assert used == {"worker": 150.0, "gateway": 5.0, "bench": 2.0}
    assert list(used) == ["worker", "gateway", "bench"]  # the biggest first
    assert cpu.percent_of_core(before, after, 0.0) == {}


@pytest.mark.skipif(not cpu.PROC.is_dir(), reason="needs /proc")
def test_snapshot_follows_a_live_process_tree():
    # a parent whose child (named like a worker) burns CPU: the child's time counts as "worker"
    burn = "import time; end = time.time() + 1.5\nwhile time.time() < end: pass"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}, 'worker'])"
    parent = subprocess.Popen([sys.executable, "-c", child])
    try:
        time.sleep(0.3)
        before = cpu.snapshot(parent.pid)
        time.sleep(0.8)
        after = cpu.snapshot(parent.pid)
    finally:
        parent.wait(timeout=30)
    assert after["worker"] - before["worker"] > 0.3  # busy most of the 0.8 s
    assert "bench" in after and cpu.snapshot(None).keys() == {"bench"}
