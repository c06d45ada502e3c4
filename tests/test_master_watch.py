"""shared/master_watch.py on a real primary, two replicas and three sentinels: after a graceful
SENTINEL FAILOVER (the old primary stays up and still answers as a master for seconds), the
watch counts one switch, loops that check it get MasterMoved once, and both an asyncio client
and the worker's step link reach the new primary at their next command, a connection that was
in use during the switch included, and the connections made after it even where a sentinel
still names the old primary. On a Redis Cluster it follows CLUSTER NODES: a primary's kill -9
and a CLUSTER FAILOVER count one switch each once the replica serves, and every loop that
checks then gets MasterMoved once, wherever it is connected."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from services.worker.step_link import StepLink
from shared.master_watch import MasterMoved, MasterWatch
from shared.redis_connect import connect
from tests.support.redis_cluster import RedisCluster
from tests.support.redis_ha import MASTER, ping

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


async def wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def served_port(client) -> int:
    return int((await client.info("server"))["tcp_port"])


async def test_a_graceful_failover_moves_every_connection_at_once(redis_ha):
    client = connect(None, redis_ha.sentinels, MASTER)
    switched: list[int] = []
    watch = MasterWatch(redis_ha.sentinels, MASTER, [client], lambda: switched.append(1)).start()
    link = StepLink(None, "steps", sentinels=redis_ha.sentinels, master=watch)
    try:
        old = redis_ha.data_ports[0]
        assert await served_port(client) == old
        assert link.read(block_ms=10) == []  # connected to the old primary, an XREAD out
        await wait_for(lambda: watch.address is not None, 5)
        # a connection in use across the switch (as one blocked in a command would be)
        pool = client.connection_pool
        in_use = await pool.get_connection()
        assert in_use.port == old
        assert redis_ha.failover() == old
        await wait_for(lambda: watch.num_switches == 1, 15)
        new = watch.address[1]
        assert new != old and switched == [1]
        assert watch.check(1) == 1  # a loop that saw the switch goes on
        assert watch.check(0, ("127.0.0.1", new)) == 1  # so does one already on the new master
        with pytest.raises(MasterMoved):
            watch.check(0, ("127.0.0.1", old))  # one on the old primary gets a connection error
        # the old primary still answers as a master (Sentinel demotes it seconds later), yet
        # every command from here on reaches the new one
        assert ping(old)
        await pool.release(in_use)  # the next command takes it first
        for _ in range(4):
            assert await served_port(client) == new
        with pytest.raises(MasterMoved):
            link.read(block_ms=10)
        await client.xadd("steps", {b"m": b"plan"})
        entries = link.read(block_ms=1000)
        assert [fields for _, fields in entries] == [{b"m": b"plan"}]
        # a sentinel that has not heard of the failover yet still names the old primary: the
        # connections made now go where the watch saw the master, not where it says
        stale = ("127.0.0.1", old)

        async def stale_answer(name: str) -> tuple[str, int]:
            return stale

        pool.sentinel_manager.discover_master = stale_answer
        link._reader.connection_pool.sentinel_manager.discover_master = lambda name: stale
        await pool.disconnect()
        link.close()
        assert await served_port(client) == new
        assert link.read(block_ms=10) == [] and link._reader.port == new
        await client.set("beat", b"1")  # a heartbeat written now reaches the new master
        assert await client.get("beat") == b"1" and pool.master_address == ("127.0.0.1", new)
        # a connection that reached the old primary anyway (it was connecting during the
        # switch) is closed at the watch's next tick, and a loop on one gets MasterMoved
        with pytest.raises(MasterMoved):
            watch.check(watch.num_switches, ("127.0.0.1", old))
        (idle,) = pool._available_connections
        await idle.disconnect()
        await idle.connect_to(("127.0.0.1", old))
        await wait_for(lambda: not idle.is_connected, 2)
        assert await served_port(client) == new
        # several such: none is handed out while the sweep closes another (a pool hands out
        # idle connections without looking at their marks)
        olds = [pool.make_connection() for _ in range(3)]
        for connection in olds:
            await connection.connect_to(("127.0.0.1", old))
        pool._available_connections.extend(olds)
        sweep = asyncio.ensure_future(watch._sweep())
        await asyncio.sleep(0)  # the sweep is closing the first of them
        taken = await pool.get_connection()
        try:
            assert taken.port == new
        finally:
            await pool.release(taken)
        await sweep
        assert not any(connection.is_connected for connection in olds)
    finally:
        link.close()
        await watch.stop()
        await client.aclose()


async def test_without_sentinels_the_watch_does_nothing():
    watch = MasterWatch(None, MASTER).start()
    assert watch._task is None
    watch.check(0)
    await watch.stop()


async def test_on_a_cluster_each_new_primary_is_a_switch():
    cluster = RedisCluster().start()
    client = connect(cluster.url, cluster=True)
    switched: list[int] = []
    watch = MasterWatch(None, MASTER, [client], lambda: switched.append(1), cluster=True).start()
    try:
        await wait_for(lambda: len(watch.owners) == 3, 5)  # 0-5460, 5461-10922, 10923-16383
        assert sorted(watch.owners) == [0, 5461, 10923]
        anywhere = ("127.0.0.1", cluster.ports[0])
        assert watch.check(0, anywhere) == 0
        # stopped for 2 s: the primary is failed, its slots without a node, and no switch yet
        killed = asyncio.create_task(asyncio.to_thread(cluster.kill, "{a}", late_s=2.0))
        await asyncio.sleep(1.5)
        assert watch.num_switches == 0
        await killed
        await wait_for(lambda: watch.num_switches == 1, 5)
        for address in (None, anywhere, ("127.0.0.1", cluster.port_of("{a}"))):
            with pytest.raises(MasterMoved):
                watch.check(0, address)
        assert watch.check(1, anywhere) == 1
        await asyncio.to_thread(cluster.fail_over, "{b}")
        await wait_for(lambda: watch.num_switches == 2, 5)
        await asyncio.sleep(1.0)  # nodes told of the failovers late name no older primary
        assert watch.num_switches == 2 and switched == [1, 1]
    finally:
        await watch.stop()
        await client.aclose()
        cluster.stop()


class SwallowsCancellation:
    """A cluster client whose CLUSTER NODES, cancelled, answers as if nothing happened (redis-py's
    cluster client swallowed a cancellation so while its nodes failed over: stop() hung)."""

    def __init__(self) -> None:
        self.num_calls = 0

    async def execute_command(self, *args):
        self.num_calls += 1
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if self.num_calls > 1:  # once only: a watch that goes on can still be ended
                raise
        return {}


async def test_stop_ends_the_watch_even_when_its_client_swallows_the_cancellation():
    client = SwallowsCancellation()
    watch = MasterWatch(None, MASTER, [client], lambda: None, cluster=True).start()
    await wait_for(lambda: client.num_calls == 1, 5)
    await asyncio.wait_for(watch.stop(), 5)
    assert watch._task is None and client.num_calls == 1
