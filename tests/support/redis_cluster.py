"""A Redis Cluster on loopback: three primaries and a replica of each, every one a
`redis-server --cluster-enabled yes` child process on a free port, the 16384 slots split evenly
by `redis-cli --cluster create` (0-5460, 5461-10922, 10923-16383)."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from tests.support.redis_ha import ping, stop_all, wait_until

NODE_TIMEOUT_MS = 1000


def cluster_ports(count: int) -> list[int]:
    """`count` ports nobody listens on, each with its cluster bus port (+ 10000) free too, all
    below Linux's ephemeral range (32768 up), where no outgoing connection takes them."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(20000, 32768 - 10000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        if port not in ports:
            ports.append(port)
    return ports


class RedisCluster:
    def __init__(self, num_primaries: int = 3, replicas: int = 1) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="textgen-redis-cluster-"))
        self.replicas = replicas  # of each primary
        self.ports = cluster_ports(num_primaries * (1 + replicas))
        self.processes: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        """A --redis-url naming one node (the client learns the others from it)."""
        return f"redis://127.0.0.1:{self.ports[0]}"

    def start(self, timeout: float = 20.0) -> RedisCluster:
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> RedisCluster:
        for port in self.ports:
            folder = self.folder / str(port)
            folder.mkdir()
            log = (folder / "redis.log").open("w")
            self.processes.append(
                subprocess.Popen(
                    ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
                    + ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
                    + ["--save", "", "--appendonly", "no"]
                    # a primary unreachable for 1 s is failed over (the default waits 15 s)
                    + ["--cluster-node-timeout", str(NODE_TIMEOUT_MS)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=folder,
                )
            )
        wait_until(lambda: all(ping(p) for p in self.ports), timeout, "nodes up")
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-yes"]
            + ["--cluster-replicas", str(self.replicas)],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        wait_until(self._is_ok, timeout, "cluster_state:ok on every node, replicas in sync")
        return self

    def port_of(self, key: str) -> int:
        """The port of the node that serves `key`'s slot, as the first live node says."""
        slot = self._client().cluster("keyslot", key)
        for first, last, (_host, port, *_), *_replicas in self._slots():
            if first <= slot <= last:
                return int(port)
        raise LookupError(f"no node serves slot {slot}")

    def _serves(self, key: str, port: int) -> bool:
        """Whether the node on `port` serves `key`'s slot now; False while no node does (during
        a failover CLUSTER SLOTS leaves the failed primary's slots out until its replica takes
        them: port_of raised there, and a kill's wait failed 1 run in ~8)."""
        try:
            return self.port_of(key) == port
        except LookupError:
            return False

    def _taken_over(self, key: str, replica: int) -> bool:
        """The replica on `replica` serves `key`'s slot and every live node knows the cluster
        is whole again: a node that has not heard of the failover yet answers CLUSTERDOWN to
        every command (a request sent to it just after a kill once got a 503 in the test)."""
        return self._serves(key, replica) and all(map(_cluster_state_ok, self._alive()))

    def _alive(self) -> list[int]:
        """The ports of the nodes whose process still runs."""
        return [port for port, p in zip(self.ports, self.processes) if p.poll() is None]

    def _client(self) -> redis.Redis:
        """A client of the first live node."""
        return redis.Redis(port=self._alive()[0], decode_responses=True)

    def _slots(self) -> list:
        """CLUSTER SLOTS: [first, last, primary, replicas...] per range."""
        return self._client().cluster("slots")

    def primaries(self) -> set[int]:
        """The ports of the nodes that serve slots now, as the first live node says."""
        return {int(port) for _first, _last, (_host, port, *_), *_ in self._slots()}

    def fail_over(self, key: str, timeout: float = 20.0) -> float:
        """A graceful CLUSTER FAILOVER of the primary serving `key` to its replica (they agree
        on the offset first: no write is lost); seconds until the replica serves the slot."""
        primary = self.port_of(key)
        replica = redis.Redis(port=primary).info("replication")["slave0"]["port"]
        started = time.monotonic()
        redis.Redis(port=replica).execute_command("CLUSTER", "FAILOVER")
        wait_until(lambda: self._taken_over(key, replica), timeout, f"failover to {replica}")
        return time.monotonic() - started

    def kill(
        self, key: str, late_s: float = 0.0, lose_s: float = 0.0, timeout: float = 30.0
    ) -> float:
        """kill -9 the primary serving `key`; seconds until its replica serves the slot. With
        `late_s`, the replica is stopped (SIGSTOP) for that long first: once the others mark the
        primary failed (after NODE_TIMEOUT_MS) the slot has no node, and every node answers
        CLUSTERDOWN until the replica takes over (a slow failover). With `lose_s` too, the
        primary drops the stopped replica's link and serves alone for that long before it dies:
        the writes it acknowledged meanwhile are lost (replication is asynchronous)."""
        primary = self.port_of(key)
        replica = redis.Redis(port=primary).info("replication")["slave0"]["port"]
        held = self.processes[self.ports.index(replica)]
        started = time.monotonic()
        if late_s:
            held.send_signal(signal.SIGSTOP)
        if lose_s:
            redis.Redis(port=primary).client_kill_filter(_type="replica")
            time.sleep(lose_s)
        self.processes[self.ports.index(primary)].kill()
        if late_s:
            time.sleep(late_s)
            held.send_signal(signal.SIGCONT)
        wait_until(lambda: self._taken_over(key, replica), timeout, f"failover to {replica}")
        return time.monotonic() - started

    def stop(self) -> None:
        stop_all(self.processes, self.folder)

    def _is_ok(self) -> bool:
        for port in self.ports:
            if not _cluster_state_ok(port):
                return False
            replication = redis.Redis(port=port, socket_timeout=1).info("replication")
            online = [replication.get(f"slave{i}", {}).get("state") for i in range(self.replicas)]
            if replication["role"] == "master" and online != ["online"] * self.replicas:
                return False
            if replication["role"] == "slave" and replication["master_link_status"] != "up":
                return False
        return True


def _cluster_state_ok(port: int) -> bool:
    """The node on `port` says cluster_state:ok (it serves, every slot has a primary)."""
    info = redis.Redis(port=port, socket_timeout=1, decode_responses=True).cluster("info")
    return info.get("cluster_state") == "ok"
