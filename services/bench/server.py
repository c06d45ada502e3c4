"""The server under test: `--url` of a running one, or a `textgen launch` child process on a
free port, stopped when the bench ends."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from services.bench.apis import Api, served_api
from services.bench.placement import Placement
from shared.net import free_port


def wait_healthy(url: str, process: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit("textgen launch exited before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} was not healthy in {timeout_s:.0f} s")


def served_dtype(url: str) -> str | None:
    """The dtype the server's workers run ("bfloat16", ...) from /info, None when unknown."""
    try:
        return httpx.get(f"{url}/info", timeout=10).json().get("model_dtype")
    except (httpx.HTTPError, ValueError):
        return None


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stderr has no descriptor
        return None


@dataclass(frozen=True)
class Served:
    url: str  # base URL to load
    pid: int | None  # the launched `textgen launch` process (None: a server given by --url)
    placement: Placement = field(default_factory=Placement)  # where its load generator runs
    api: Api = field(default_factory=Api)  # what the requests look like (--api)


@contextmanager
def server(
    url: str | None,
    model_id: str,
    extra_args: Sequence[str] = (),
    timeout_s: float = 600.0,
    placement: Placement | None = None,
    api: str = "tgi",
) -> Iterator[Served]:
    """The server to load: `url` as given, else a launched one (`textgen launch` with
    `extra_args` added, and --worker-cpus when `placement` splits the CPUs), loaded through
    `api` (services/bench/apis.py)."""
    placement = placement or Placement()
    if url is not None:
        url = url.rstrip("/")
        wait_healthy(url, None, 30.0)
        yield Served(url, None, placement, served_api(api, url))
        return
    port = free_port()
    argv = [sys.executable, "-m", "services.launcher.cli", "launch", "--model-id", model_id]
    argv += ["--port", str(port), "--log-level", "WARNING", *placement.launch_args()]
    # its output goes to stderr: stdout carries the report (--json must stay parseable)
    process = subprocess.Popen([*argv, *extra_args], stdout=_stderr_fd())
    try:
        launched = f"http://127.0.0.1:{port}"
        wait_healthy(launched, process, timeout_s)
        yield Served(launched, process.pid, placement, served_api(api, launched))
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
