"""Real services as child processes (`python -m services.launcher.cli ...`) on a private Redis:
N worker groups (worker + scheduler each) and M gateways, each on its own port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from shared.channels import SCHEDULER_GROUP, Channels
from shared.codec import decode
from shared.messages import SchedulerStats
from shared.openmp import share_cores, share_threads
from tests.support.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
_GIVEN_PORTS: set[int] = set()  # every port a cluster of this process handed to a service


def service_port() -> int:
    """A free port no cluster of this process gave out before: the OS may hand a port out
    again before the service it went to has bound it (a worker and its scheduler once got
    the same metrics port, and the worker could not start)."""
    while (port := free_port()) in _GIVEN_PORTS:
        pass
    _GIVEN_PORTS.add(port)
    return port


@dataclass
class Cluster:
    redis_url: str
    namespace: str
    model: Path
    num_groups: int = 1
    num_gateways: int = 1
    args: list[str] = field(default_factory=list)  # extra flags for every service
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    gateway_urls: list[str] = field(default_factory=list)
    ops_urls: dict[str, str] = field(default_factory=dict)  # worker/scheduler name -> /metrics base

    @property
    def groups(self) -> list[str]:
        return [f"g{i}" for i in range(self.num_groups)]

    def _spawn(self, name: str, command: str, *flags: str) -> None:
        log = Path(tempfile.mkstemp(prefix=f"textgen-{name}-", suffix=".log")[1])
        self.logs[name] = log
        argv = [
            sys.executable,
            "-m",
            "services.launcher.cli",
            command,
            "--redis-url",
            self.redis_url,
            "--namespace",
            self.namespace,
            "--model-id",
            str(self.model),
            *self.args,
            *flags,
        ]
        env = dict(os.environ)
        if command == "worker":  # as `textgen launch` gives them: the cores are shared
            share_cores(env)
            shards = int(argv[argv.index("--num-shard") + 1]) if "--num-shard" in argv else 1
            share_threads(env, len(os.sched_getaffinity(0)), self.num_groups * shards)
        self.processes[name] = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
        )

    def start(self, timeout: float = 180.0) -> Cluster:
        for group in self.groups:
            for service in ("worker", "scheduler"):
                port = service_port()
                self.ops_urls[f"{service}-{group}"] = f"http://127.0.0.1:{port}"
                self._spawn(
                    f"{service}-{group}", service, "--group", group, "--metrics-port", str(port)
                )
        for _ in range(self.num_gateways):
            self.gateway_urls.append(self._spawn_gateway())
        self.wait_ready(timeout)
        return self

    def _spawn_gateway(self, *flags: str) -> str:
        i = sum(name.startswith("gateway-") for name in self.processes)
        port = service_port()
        self._spawn(
            f"gateway-{i}",
            "gateway",
            "--port",
            str(port),
            "--hostname",
            "127.0.0.1",
            "--gateway-id",
            f"gw{i}",
            *flags,
        )
        return f"http://127.0.0.1:{port}"

    def add_gateway(self, *flags: str, timeout: float = 60.0) -> str:
        """One more gateway on the running cluster, with its own flags; its URL once healthy."""
        url = self._spawn_gateway(*flags)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"gateway {url} not ready\n{self.log_tails()}")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = set(self.gateway_urls)
        client = redis.Redis.from_url(self.redis_url)
        channels = Channels(self.namespace)
        while time.monotonic() < deadline:
            self.check_alive()
            for url in list(pending):
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        pending.discard(url)
                except httpx.HTTPError:
                    pass
            groups_ready = all(
                client.exists(channels.worker(g), channels.scheduler_stats(g)) == 2
                for g in self.groups
            )
            if not pending and groups_ready:
                return
            time.sleep(0.2)
        raise TimeoutError(f"cluster not ready in {timeout} s\n{self.log_tails()}")

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}\n{self.log_tails()}")

    @contextlib.contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """Service `name` stopped (SIGSTOP) for the block and resumed after it: what arrives
        meanwhile waits for it, whatever the host's speed."""
        process = self.processes[name]
        process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            process.send_signal(signal.SIGCONT)

    def lane_entries(self) -> int:
        """Entries in the lanes' streams, taken or not (a paused scheduler takes none)."""
        client = redis.Redis.from_url(self.redis_url)
        return sum(client.xlen(lane) for lane in Channels(self.namespace).lanes)

    def taken_entries(self) -> int:
        """Lane entries a scheduler read and has not let go (its requests unfinished): no
        snapshot's lag, unlike stats."""
        client = redis.Redis.from_url(self.redis_url)
        taken = 0
        for lane in Channels(self.namespace).lanes:
            try:
                taken += client.xpending(lane, SCHEDULER_GROUP)["pending"]
            except redis.ResponseError:  # no scheduler made the group yet
                pass
        return taken

    def stats(self) -> dict[str, SchedulerStats]:
        client = redis.Redis.from_url(self.redis_url)
        channels = Channels(self.namespace)
        out = {}
        for group in self.groups:
            data = client.get(channels.scheduler_stats(group))
            if data is not None:
                out[group] = decode(data, SchedulerStats)
        return out

    async def wait_running(self, count: int = 1, timeout: float = 60.0) -> None:
        """Until the groups' stats show `count` requests running (they lag by up to the
        scheduler's STATS_INTERVAL_S); TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while sum(s.num_running for s in self.stats().values()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} requests never ran at once: {self.stats()}")
            await asyncio.sleep(0.01)

    def wait_idle(
        self, timeout: float = 30.0, groups: list[str] | None = None
    ) -> dict[str, SchedulerStats]:
        """Stats once every group of `groups` (default: all) has no request and every block
        free again; TimeoutError when that takes over `timeout` seconds."""
        groups = self.groups if groups is None else groups
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if all(
                g in stats
                and stats[g].num_running == 0
                and stats[g].num_waiting == 0
                and stats[g].num_free_blocks == stats[g].num_blocks
                for g in groups
            ):
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"groups {groups} not idle after {timeout} s: {stats}")
            time.sleep(0.1)

    def log_tails(self, num_chars: int = 3000) -> str:
        parts = []
        for name, log in self.logs.items():
            text = log.read_text(errors="replace") if log.exists() else ""
            parts.append(f"--- {name} ---\n{text[-num_chars:]}")
        return "\n".join(parts)

    def stacks(self, services: tuple[str, ...] = ("worker", "scheduler", "gateway")) -> str:
        """Each running service's threads and tasks, from its own dump (SIGUSR1: shared/aio.py):
        where a stuck one waits."""
        running = [name for name, p in self.processes.items() if p.poll() is None]
        names = [name for name in running if name.startswith(services)]
        sizes = {name: self.logs[name].stat().st_size for name in names}
        for name in names:
            self.processes[name].send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        parts = []
        for name in names:
            with self.logs[name].open("rb") as log:
                log.seek(sizes[name])
                parts.append(f"--- {name}: stacks ---\n{log.read().decode(errors='replace')}")
        return "\n".join(parts)

    def exit_code(self, name: str, timeout: float) -> int:
        """Service `name`'s exit status once it exits; failing, with its stacks and every
        log's tail, if it is still running after `timeout` seconds."""
        try:
            return self.processes[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = self.stacks((name,))
            raise AssertionError(
                f"{name} still running after {timeout} s\n{stacks}\n{self.log_tails()}"
            ) from None

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def generated_ids(url: str, prompt: str, max_new_tokens: int, timeout: float = 120.0) -> list[int]:
    """The token ids a greedy /generate returns for `prompt` (asserting a 200)."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    response = httpx.post(f"{url}/generate", json=body, timeout=timeout)
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


async def sse_events(
    http: httpx.AsyncClient, body: dict, events: list[dict] | None = None
) -> list[dict]:
    """Every event of a /generate_stream answer to `body` (asserting a 200), appended to
    `events` as they come when given (what a stream that hangs got so far)."""
    events = [] if events is None else events
    async with http.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:") :]))
    return events
