"""A small layer over Redis: typed messages in and out of streams, keys and pub/sub.

Services own their loops; this module only knows how messages map to Redis commands.
Everything is asyncio (redis.asyncio); callers batch work with `pipeline()` where it matters.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import msgspec
import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.typing import EncodableT, FieldT

from shared.codec import decode, encode

if TYPE_CHECKING:
    from shared.channels import Channels
    from shared.settings import Settings

T = TypeVar("T")
log = logging.getLogger(__name__)

FIELD = b"m"  # stream entries hold one field whose value is the msgpack message
# what a Redis outage raises: loops catch these, back off and retry
REDIS_ERRORS = (aioredis.ConnectionError, aioredis.TimeoutError, OSError, TimeoutError)


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
                        reply = await sentinel.execute_command(
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
                    reply = sentinel.execute_command(
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


def connect(
    url: str | None, sentinels: str | None = None, master: str = "mymaster"
) -> aioredis.Redis:
    """A Redis client (a connection pool) that returns raw bytes: to `url`, or with
    `sentinels` to the master they name (`url` then gives only credentials and db)."""
    options: dict[str, Any] = {
        "decode_responses": False,
        "health_check_interval": 30,
        "socket_connect_timeout": 5,
    }
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


def client_for(settings: Settings) -> aioredis.Redis:
    """The services' Redis client: --redis-url, or the master --redis-sentinels follow."""
    return connect(settings.redis_url, settings.redis_sentinels, settings.redis_sentinel_master)


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


def sync_pool(
    url: str | None, sentinels: str | None = None, master: str = "mymaster", **options: Any
) -> redis.ConnectionPool:
    """connect()'s choice for the synchronous client (the worker's torch thread, the CLI)."""
    if not sentinels:
        assert url, "a Redis URL or sentinels"
        return redis.ConnectionPool.from_url(url, **options)
    sentinel = sentinel_client(sentinels, asynchronous=False, socket_connect_timeout=5)
    master_client = sentinel.master_for(
        master, connection_class=_following_connection(), **options, **_master_auth(url)
    )
    pool: redis.ConnectionPool = master_client.connection_pool
    return pool


async def group_states(
    client: aioredis.Redis, channels: Channels
) -> list[tuple[str, bytes | None, bool]]:
    """Every registered worker group: (group, its Heartbeat's bytes or None once it stopped
    beating, whether it drains), in two round trips."""
    groups = sorted(as_text(raw) for raw in await client.smembers(channels.groups))
    async with client.pipeline(transaction=False) as pipe:
        for group in groups:
            pipe.get(channels.heartbeat(group))
            pipe.exists(channels.drain(group))
        replies = await pipe.execute()
    return [
        (group, beat, bool(draining))
        for group, beat, draining in zip(groups, replies[::2], replies[1::2], strict=True)
    ]


async def wait_for_redis(client: aioredis.Redis, timeout: float = 30.0) -> None:
    """Wait until Redis answers PING (start-up ordering in compose/k8s)."""
    deadline = asyncio.get_running_loop().time() + timeout
    delay = 0.05
    while True:
        try:
            await client.ping()
            return
        except (OSError, aioredis.ConnectionError) as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise ConnectionError(f"Redis unreachable: {exc}") from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


def stream_fields(message: msgspec.Struct) -> dict[FieldT, EncodableT]:
    """Fields of a stream entry holding `message`."""
    return {FIELD: encode(message)}


def pairs_to_fields(pairs: list[bytes]) -> dict[bytes, bytes]:
    """A stream entry's fields from the flat [field, value, ...] list a script returns."""
    return dict(zip(pairs[::2], pairs[1::2], strict=True))


def entry_message(fields: dict[bytes, bytes], kind: type[T]) -> T:
    """The message inside a stream entry."""
    return decode(fields[FIELD], kind)


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    """Create a consumer group (and the stream) if missing."""
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def read_stream(
    client: aioredis.Redis, stream: str, last_id: bytes, kind: type[T], block_ms: int | None
) -> list[tuple[bytes, T]]:
    """XREAD entries after `last_id` (blocking up to block_ms; None = do not block)."""
    return stream_entries(await client.xread({stream: last_id}, block=block_ms), kind)


def stream_entries(reply: Any, kind: type[T]) -> list[tuple[bytes, T]]:
    """The (entry id, message) pairs of an XREAD reply (None when it timed out)."""
    out: list[tuple[bytes, T]] = []
    for _name, entries in reply or []:
        for entry_id, fields in entries:
            out.append((entry_id, entry_message(fields, kind)))
    return out


async def get_message(client: aioredis.Redis, key: str, kind: type[T]) -> T | None:
    """The message stored under a key, or None."""
    data = await client.get(key)
    return None if data is None else decode(as_bytes(data), kind)


def as_text(value: bytes | str) -> str:
    """A Redis reply as text."""
    return value.decode() if isinstance(value, bytes) else value


def as_bytes(value: bytes | str) -> bytes:
    """A Redis reply as bytes (clients made with decode_responses hand over str)."""
    return value.encode() if isinstance(value, str) else value
