"""shared/redis_connect.py's connection for Redis Cluster nodes, on a real Redis: a write to a
connection whose transport closed under it (a cluster client that met CLUSTERDOWN closes every
node's connections while other tasks use them) raises redis's ConnectionError on the services'
loop (uvloop), which the outage handlers catch. Before redis-py 8.2 its own connection raised
RuntimeError there, which ended the scheduler in a kill -9 failover, and a write after another
task's disconnect dropped the stream writer raised AttributeError, which ended it too; 8.2
checks the writer first and raises ConnectionError, and `redis>=5.0` allows either."""

from __future__ import annotations

import shutil
from urllib.parse import urlsplit

import pytest
import redis
import redis.asyncio as aioredis

from shared import aio
from shared.redis_connect import ClusterNodeConnection

# redis-py 8.2 checks for a closed or dropped writer before it writes (ConnectionError)
CHECKS_WRITER = tuple(int(part) for part in redis.__version__.split(".")[:2]) >= (8, 2)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


@pytest.fixture
def redis_port(redis_url) -> int:
    """The port of the test's Redis (its URL is redis://127.0.0.1:PORT/DB)."""
    port = urlsplit(redis_url).port
    assert port is not None
    return port


async def _write_after_close(connection_class: type[aioredis.Connection], port: int) -> None:
    connection = connection_class(host="127.0.0.1", port=port)
    await connection.connect()
    await connection.send_command("PING")
    assert await connection.read_response() == b"PONG"
    connection._writer.transport.close()  # type: ignore[union-attr]  # as aclose() elsewhere
    try:
        await connection.send_command("PING", check_health=False)
    finally:
        await connection.disconnect()


@pytest.mark.parametrize(
    ("connection_class", "raised"),
    [
        (ClusterNodeConnection, redis.ConnectionError),
        (aioredis.Connection, redis.ConnectionError if CHECKS_WRITER else RuntimeError),
    ],
)
def test_a_write_to_a_closed_connection_is_a_lost_connection(redis_port, connection_class, raised):
    pytest.importorskip("uvloop")
    with pytest.raises(raised, match="closed"):
        aio.run(_write_after_close(connection_class, redis_port))


class _ClosedUnderIt:
    """Another task's disconnect() runs between redis-py's is-connected check and its write
    (CLUSTERDOWN's reset of every node's connections, during a reconnect's handshake)."""

    async def _send_packed_command(self, command) -> None:
        self._writer = None
        await super()._send_packed_command(command)  # type: ignore[misc]


async def _write_after_disconnect(connection_class: type[aioredis.Connection], port: int) -> None:
    closing = type("Closing", (_ClosedUnderIt, connection_class), {})
    connection = closing(host="127.0.0.1", port=port)
    try:
        await connection.connect()  # its handshake's first write (CLIENT SETINFO) meets it
        await connection.send_command("PING", check_health=False)
    finally:
        await connection.disconnect()


@pytest.mark.parametrize(
    ("connection_class", "raised", "match"),
    [
        (
            ClusterNodeConnection,
            redis.ConnectionError,
            "closed by the server" if CHECKS_WRITER else "closed connection.*NoneType",
        ),
        (
            aioredis.Connection,
            redis.ConnectionError if CHECKS_WRITER else AttributeError,
            "closed by the server" if CHECKS_WRITER else "NoneType",
        ),
    ],
)
def test_a_write_after_a_disconnect_under_it_is_a_lost_connection(
    redis_port, connection_class, raised, match
):
    with pytest.raises(raised, match=match):
        aio.run(_write_after_disconnect(connection_class, redis_port))
