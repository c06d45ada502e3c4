"""CPU used by each part of the system during a level: the launched server's processes by role
(worker, scheduler, gateway, redis, launcher) and the bench client itself, in percent of one
core. On a machine where the control plane shares cores with the forward pass, this is what
the broker path costs in compute (read from /proc; empty where there is none)."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

PROC = Path("/proc")
ROLES = ("worker", "scheduler", "gateway", "redis", "launch")  # matched in the command line


def parse_stat(text: str) -> tuple[int, float]:
    """(parent pid, CPU ticks in user + system mode) from a /proc/PID/stat line. The command
    name (field 2) may hold spaces and parentheses, so fields are counted after its last ')'."""
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is the state (field 3); ppid is field 4, utime 14, stime 15
    return int(fields[1]), float(fields[11]) + float(fields[12])


def role_of(cmdline: str) -> str:
    """The part of the system a command line runs ("other" if none)."""
    words = cmdline.split()
    if words and Path(words[0]).name.startswith("redis-server"):
        return "redis"
    for role in ROLES:
        if role in words:
            return "launcher" if role == "launch" else role
    return "other"


def _read(pid: int, name: str) -> str | None:
    try:
        return (PROC / str(pid) / name).read_text()
    except OSError:  # gone, or no /proc
        return None


def _tree(root: int) -> list[int]:
    """root and every process below it."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in PROC.glob("[0-9]*") if PROC.is_dir() else []:
        text = _read(int(entry.name), "stat")
        if text is not None:
            children[parse_stat(text)[0]].append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def snapshot(server_pid: int | None) -> dict[str, float]:
    """CPU seconds so far per role: the server's tree (if launched) and "bench" (this
    process)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    seconds: dict[str, float] = defaultdict(float)
    pids = [(os.getpid(), "bench")]
    if server_pid is not None:
        for pid in _tree(server_pid):
            cmdline = _read(pid, "cmdline")
            if cmdline is not None:
                pids.append((pid, role_of(cmdline.replace("\0", " "))))
    for pid, role in pids:
        text = _read(pid, "stat")
        if text is not None:
            seconds[role] += parse_stat(text)[1] / ticks
    return dict(seconds)


def percent_of_core(
    before: dict[str, float], after: dict[str, float], wall_s: float
) -> dict[str, float]:
    """Per role, CPU time between two snapshots over the wall time, in % of one core (roles of
    processes that exited in between are left out)."""
    if wall_s <= 0:
        return {}
    return {
        role: round(100 * (after[role] - before.get(role, 0.0)) / wall_s, 1)
        for role in sorted(after, key=lambda r: -(after[r] - before.get(r, 0.0)))
        if role in before
    }
