"""How the services reach Redis: one server (--redis-url), the master Redis Sentinel names
(--redis-sentinels), or a Redis Cluster (--redis-cluster). Key names are cluster-safe
(shared/channels.py), so the services' commands are the same against each.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis

from shared.bus import as_text

if TYPE_CHECKING:
    from shared.settings import Settings


class DemotedWhileBlocked(redis.ConnectionError):
    """Redis's UNBLOCKED reply: it ended a blocking command (XREAD BLOCK, XREADGROUP BLOCK)
    because it stopped being a primary (a failover demoted it). The services recover as from a
    lost connection, and a cluster client asks the cluster where the key went (as redis-py's
    ResponseError, the scheduler and worker loops would end)."""


def _recover_from_unblocked() -> None:
    """redis-py's parsers (its own and hiredis's) raise DemotedWhileBlocked for UNBLOCKED."""
    from redis._parsers.base import BaseParser

    BaseParser.EXCEPTION_CLASSES.setdefault("UNBLOCKED", DemotedWhileBlocked)


_recover_from_unblocked()


class ClusterNodeConnection(aioredis.Connection):
    """redis-py's connection for a cluster client: a write to a connection closed under it
    raises ConnectionError, which the outage handlers catch. A cluster client that meets
    CLUSTERDOWN closes every node's connections while other tasks still use them: on uvloop a
    write to a closed transport raises RuntimeError ("the handler is closed"), and a write
    after the disconnect dropped the stream writer (between redis-py's is-connected check and
    its write, as in the handshake of a reconnect) raises AttributeError ("'NoneType' object
    has no attribute 'writelines'"); either ended the scheduler in a kill -9 failover. redis-py
    8.2 checks the writer first and raises ConnectionError itself; older ones need this."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except (RuntimeError, AttributeError) as exc:
            closed = "closed" if isinstance(exc, RuntimeError) else "'NoneType'"
            if closed not in str(exc):
                raise
            raise redis.ConnectionError(f"writing to a closed connection: {exc}") from exc


def _use_node_connections(client: aioredis.RedisCluster) -> aioredis.RedisCluster:
    """`client` with ClusterNodeConnection for every node: those it knows, and those it learns
    (they are made from its connection_kwargs; redis-py takes no connection class for a
    cluster)."""
    client.connection_kwargs["connection_class"] = ClusterNodeConnection
    for node in [*client.startup_nodes, *client.nodes_manager.startup_nodes.values()]:
        node.connection_class = ClusterNodeConnection
    return client


def redact_url(url: str | None) -> str:
    """`url` safe to log: the password (user:PASSWORD@ or ?password=) replaced by `***`."""
    if not url:
        return ""
    try:
        parts = urlsplit(url)
    except ValueError:
        return re.sub(r"//[^@/]*@", "//***@", url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0] if ":" in userinfo else userinfo
        # a lone userinfo (redis://secret@host) is Redis's password-only form
        netloc = f"{user}:***@{host}" if ":" in userinfo else f"***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, "***" if k.lower() in ("password", "pass") else v) for k, v in pairs], safe="*"
        )
    if "://" not in url:
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def sentinel_addresses(text: str) -> list[tuple[str, int]]:
    """--redis-sentinels "host:port,host:port" as (host, port) pairs; ValueError when bad."""
    addresses = []
    for part in (p.strip() for p in text.split(",")):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"redis_sentinels must be host:port,... not {text!r}")
        addresses.append((host, int(port)))
    if not addresses:
        raise ValueError("redis_sentinels names no sentinel")
    return addresses


def _master_auth(url: str | None) -> dict[str, Any]:
    """Username, password and db of `url` (host and port come from the sentinels)."""
    if not url:
        return {}
    parts = urlsplit(url)
    auth: dict[str, Any] = {"username": parts.username, "password": parts.password}
    if parts.path.strip("/").isdigit():
        auth["db"] = int(parts.path.strip("/"))
    return {k: v for k, v in auth.items() if v is not None}


def _first_to_name(sentinels: list[Any], number: int, reply: Any) -> tuple[str, int] | None:
    """The master sentinel `number` named in its GET-MASTER-ADDR-BY-NAME `reply`, as
    (host, port), that sentinel then asked first next time; None when it named none."""
    if not reply:
        return None
    sentinels[0], sentinels[number] = sentinels[number], sentinels[0]
    return as_text(reply[0]), int(reply[1])


def _sentinel_class(asynchronous: bool) -> type:
    """redis-py's Sentinel, asking as the Sentinel client spec says: GET-MASTER-ADDR-BY-NAME of
    each sentinel in turn, the first answer wins (it names the promoted replica as soon as the
    failover promoted it; redis-py's SENTINEL MASTERS names it only at the failover's end, ~1 s
    later, and nothing while the old primary is down)."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if asynchronous:
        from redis.asyncio.sentinel import MasterNotFoundError
        from redis.asyncio.sentinel import Sentinel as AsyncSentinel

        class SpecAsyncSentinel(AsyncSentinel):
            async def discover_master(self, service_name: str) -> tuple[str, int]:
                for number, sentinel in enumerate(self.sentinels):
                    try:
                        # untyped in redis 8.2, typed before
                        reply = await sentinel.execute_command(  # type: ignore[no-untyped-call, unused-ignore]
                            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", service_name
                        )
                    except (RedisConnectionError, RedisTimeoutError, OSError):
                        continue
                    if (address := _first_to_name(self.sentinels, number, reply)) is not None:
                        return address
                raise MasterNotFoundError(f"no sentinel names a master {service_name!r}")

        return SpecAsyncSentinel
    from redis.sentinel import MasterNotFoundError as SyncMasterNotFoundError
    from redis.sentinel import Sentinel as SyncSentinel

    class SpecSentinel(SyncSentinel):
        def discover_master(self, service_name: str) -> tuple[str, int]:
            for number, sentinel in enumerate(self.sentinels):
                try:
                    reply = sentinel.execute_command(  # type: ignore[no-untyped-call, unused-ignore]
                        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", service_name
                    )
                except (RedisConnectionError, RedisTimeoutError, OSError):
                    continue
                if (address := _first_to_name(self.sentinels, number, reply)) is not None:
                    return address
            raise SyncMasterNotFoundError(f"no sentinel names a master {service_name!r}")

    return SpecSentinel


def sentinel_client(sentinels: str, asynchronous: bool = True, **options: Any) -> Any:
    """A Sentinel (redis-py's, asking as the spec says) for "host:port,..."."""
    cls = _sentinel_class(asynchronous)
    return cls(sentinel_addresses(sentinels), **options)


# a master's failover takes seconds: redis-py's own retries would reconnect to the old address
# (redis/redis-py#3874), so they stay few and short, and the services retry instead
SENTINEL_RETRIES = 3
MAX_CONNECTIONS = 100  # redis-py's pools' bound (per node of a cluster), raised where callers need


def connect(
    url: str | None,
    sentinels: str | None = None,
    master: str = "mymaster",
    cluster: bool = False,
    max_connections: int | None = None,
) -> aioredis.Redis:
    """A Redis client (a connection pool) that returns raw bytes: to `url`, or with
    `sentinels` to the master they name (`url` then gives only credentials and db), or with
    `cluster` to the Redis Cluster whose node `url` names (redis-py's RedisCluster: it routes
    each command to its key's node and follows MOVED; it has every command the services send,
    so it is typed as the plain client). `max_connections`: per server, at least (redis-py's
    pools hold 100)."""
    options: dict[str, Any] = {
        "decode_responses": False,
        "health_check_interval": 30,
        "socket_connect_timeout": 5,
        "max_connections": max(MAX_CONNECTIONS, max_connections or 0),
    }
    if cluster:
        assert url, "a Redis Cluster node's URL"
        cluster_client = aioredis.RedisCluster.from_url(url, **options)
        return cast(aioredis.Redis, _use_node_connections(cluster_client))
    if not sentinels:
        assert url, "a Redis URL or sentinels"
        return aioredis.from_url(url, **options)
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    sentinel = sentinel_client(sentinels, socket_connect_timeout=5)
    retry = Retry(ExponentialBackoff(cap=0.2, base=0.01), SENTINEL_RETRIES)
    client: aioredis.Redis = sentinel.master_for(
        master, redis_class=aioredis.Redis, retry=retry, **options, **_master_auth(url)
    )
    return client


def client_for(settings: Settings, max_connections: int | None = None) -> aioredis.Redis:
    """The services' Redis client: --redis-url, the master --redis-sentinels follow, or the
    cluster --redis-cluster names."""
    return connect(
        settings.redis_url,
        settings.redis_sentinels,
        settings.redis_sentinel_master,
        settings.redis_cluster,
        max_connections,
    )


async def pubsub_of(client: aioredis.Redis) -> aioredis.client.PubSub:
    """client.pubsub(), a cluster client's after asking the cluster for its slots (its
    commands follow MOVED, its pub/sub does not: a subscription lost with a failed node must
    go to the replica that took over)."""
    if isinstance(client, aioredis.RedisCluster):
        await client.nodes_manager.initialize()
    return client.pubsub()


def node_client(cluster: aioredis.RedisCluster, key: str) -> aioredis.Redis:
    """A plain client to the node of `cluster` that serves `key` now (for commands that must
    share one connection with a write to it: WAIT)."""
    node = cluster.get_node_from_key(key)
    if node is None:
        raise redis.ConnectionError(f"no Redis Cluster node serves {key!r}")
    pool = aioredis.ConnectionPool(
        connection_class=node.connection_class,
        **{**node.connection_kwargs, "host": node.host, "port": node.port},
    )
    return aioredis.Redis(connection_pool=pool)


def _following_connection() -> type:
    """redis-py's sentinel connection for the synchronous client, made to ask the sentinels
    where it connects: redis-py 8.1's send_packed_command connects through
    connect_check_health, past SentinelManagedConnection.connect, and so reaches the default
    localhost:6379 instead of the master."""
    from redis.sentinel import SentinelManagedConnection

    class FollowingConnection(SentinelManagedConnection):
        def connect_check_health(
            self, check_health: bool = True, retry_socket_connect: bool = True
        ) -> None:
            if not self._sock and self.connection_pool.is_master:
                self.host, self.port = self.connection_pool.get_master_address()
            super().connect_check_health(check_health, retry_socket_connect)

    return FollowingConnection


def _key_node_connection(node_address: Callable[[], tuple[str, int]]) -> type:
    """A connection to the address `node_address` gives, asked at each connect (a failover or
    a resharding moves a key to another node: a refused or lost command reconnects there)."""

    class KeyNodeConnection(redis.Connection):
        def connect_check_health(
            self, check_health: bool = True, retry_socket_connect: bool = True
        ) -> None:
            if not self._sock:
                self.host, self.port = node_address()
            super().connect_check_health(check_health, retry_socket_connect)

    return KeyNodeConnection


class KeyNodePool(redis.ConnectionPool):
    """Connections to the node of a Redis Cluster that serves `key` (the worker's step link:
    its streams and the replies it publishes all go to its group's node)."""

    def __init__(self, url: str, key: str, **options: Any) -> None:
        from redis.cluster import RedisCluster as SyncRedisCluster

        parts = urlsplit(url)
        super().__init__(
            connection_class=_key_node_connection(self.node_address),
            username=parts.username,
            password=parts.password,
            **options,
        )
        self.key = key  # the key whose node the connections reach
        self._cluster = SyncRedisCluster.from_url(url, socket_connect_timeout=5)

    def node_address(self) -> tuple[str, int]:
        """(host, port) of the node serving `key`, after asking the cluster for its slots."""
        self._cluster.nodes_manager.initialize()
        node: Any = self._cluster.get_node_from_key(self.key)  # type: ignore[no-untyped-call]
        return node.host, int(node.port)


def sync_pool(
    url: str | None,
    sentinels: str | None = None,
    master: str = "mymaster",
    cluster_key: str | None = None,
    **options: Any,
) -> redis.ConnectionPool:
    """connect()'s choice for the synchronous client of one thread (the worker's torch
    thread); with `cluster_key` (--redis-cluster), connections to the node serving that key."""
    if cluster_key is not None:
        assert url, "a Redis Cluster node's URL"
        return KeyNodePool(url, cluster_key, **options)
    if not sentinels:
        assert url, "a Redis URL or sentinels"
        return redis.ConnectionPool.from_url(url, **options)
    sentinel = sentinel_client(sentinels, asynchronous=False, socket_connect_timeout=5)
    master_client = sentinel.master_for(
        master, connection_class=_following_connection(), **options, **_master_auth(url)
    )
    pool: redis.ConnectionPool = master_client.connection_pool
    return pool


def sync_client(settings: Settings, **options: Any) -> redis.Redis:
    """A synchronous client for the command line (`textgen queue`), as client_for chooses."""
    if settings.redis_cluster:
        from redis.cluster import RedisCluster as SyncRedisCluster

        assert settings.redis_url, "a Redis Cluster node's URL"
        return cast(redis.Redis, SyncRedisCluster.from_url(settings.redis_url, **options))
    pool = sync_pool(
        settings.redis_url, settings.redis_sentinels, settings.redis_sentinel_master, **options
    )
    return redis.Redis(connection_pool=pool)
