"""Redis with Sentinel on loopback, for failover tests: a primary, two replicas and three
sentinels (the deployment the README recommends), each a `redis-server` child process on a free
port, as in ../shared/reference/redis-ha.md §6 (down-after 1000 ms, diskless sync at once)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from shared.net import free_port

MASTER = "mymaster"
DOWN_AFTER_MS = 1000


def ping(port: int) -> bool:
    """Whether a Redis on loopback at `port` answers."""
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def stop_all(processes: list[subprocess.Popen], folder: Path) -> None:
    """kill -9 what still runs of `processes`, then remove `folder`."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    shutil.rmtree(folder, ignore_errors=True)


def wait_until(check, timeout: float, what: str) -> None:
    """Return once check() is true (a Redis error counts as false); TimeoutError naming `what`
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"Redis: no {what} within {timeout:.0f} s")


class RedisHA:
    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="textgen-redis-ha-"))
        self.data_ports = [free_port() for _ in range(3)]  # the primary first, then replicas
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.processes: dict[int, subprocess.Popen] = {}

    @property
    def sentinels(self) -> str:
        """The --redis-sentinels value."""
        return ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)

    def _spawn(self, port: int, *args: str) -> None:
        log = (self.folder / f"{port}.log").open("w")
        self.processes[port] = subprocess.Popen(
            ["redis-server", *args], stdout=log, stderr=subprocess.STDOUT, cwd=self.folder
        )

    def start(self, timeout: float = 20.0) -> RedisHA:
        primary = self.data_ports[0]
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        common += ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        for port in self.data_ports:
            replica = [] if port == primary else ["--replicaof", "127.0.0.1", str(primary)]
            self._spawn(port, "--port", str(port), *common, *replica)
        wait_until(lambda: all(ping(p) for p in self.data_ports), timeout, "servers up")
        wait_until(self._replicas_synced, timeout, "replicas in sync")
        for port in self.sentinel_ports:
            config = self.folder / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER} 10000\n"
            )
            self._spawn(port, str(config), "--sentinel")
        wait_until(lambda: self.primary_port() == primary, timeout, "sentinels agree")
        # a SENTINEL FAILOVER needs a replica the sentinels know (else NOGOODSLAVE)
        wait_until(self._replicas_known, timeout, "replicas known to every sentinel")
        return self

    def primary_port(self) -> int | None:
        """The primary's port as a sentinel answers it, or None."""
        for port in self.sentinel_ports:
            try:
                client = redis.Redis(port=port, socket_timeout=1)
                address = client.execute_command("SENTINEL", "get-master-addr-by-name", MASTER)
            except redis.RedisError:
                continue
            if address:
                return int(address[1])
        return None

    def kill_primary(self) -> int:
        """kill -9 the current primary; its port."""
        port = self.primary_port()
        assert port is not None
        self.processes[port].send_signal(signal.SIGKILL)
        self.processes[port].wait(timeout=10)
        return port

    def failover(self) -> int:
        """A graceful SENTINEL FAILOVER (the old primary stays up); the old primary's port."""
        port = self.primary_port()
        assert port is not None
        redis.Redis(port=self.sentinel_ports[0]).execute_command("SENTINEL", "FAILOVER", MASTER)
        return port

    def lag_replicas_then_kill_primary(self, lag_s: float = 0.5) -> int:
        """SIGSTOP the replicas for `lag_s` (writes pile up on the primary alone), kill -9 the
        primary, SIGCONT the replicas: the promoted one lacks the newest writes. Its port."""
        primary = self.primary_port()
        assert primary is not None
        replicas = [p for p in self.data_ports if p != primary]
        for port in replicas:
            self.processes[port].send_signal(signal.SIGSTOP)
        time.sleep(lag_s)
        self.processes[primary].send_signal(signal.SIGKILL)
        self.processes[primary].wait(timeout=10)
        for port in replicas:
            self.processes[port].send_signal(signal.SIGCONT)
        return primary

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> float:
        """Seconds until the sentinels name a new primary that answers."""
        started = time.monotonic()
        wait_until(
            lambda: (port := self.primary_port()) not in (None, old_port) and ping(port),
            timeout,
            "a new primary",
        )
        return time.monotonic() - started

    def stop(self) -> None:
        stop_all(list(self.processes.values()), self.folder)

    def _replicas_known(self) -> bool:
        for port in self.sentinel_ports:
            client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
            replicas = client.execute_command("SENTINEL", "REPLICAS", MASTER)
            # redis-py parses each replica into a dict (RESP2 gives field, value, ...)
            fields = [r if isinstance(r, dict) else dict(zip(r[::2], r[1::2])) for r in replicas]
            flags = [str(f["flags"]) for f in fields]
            if len(flags) < 2 or any("down" in f or "disconnected" in f for f in flags):
                return False
        return True

    def _replicas_synced(self) -> bool:
        for port in self.data_ports[1:]:
            info = redis.Redis(port=port, socket_timeout=1).info("replication")
            if info.get("master_link_status") != "up":
                return False
        return True
