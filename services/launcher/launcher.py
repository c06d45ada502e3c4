"""`textgen launch`: an embedded Redis (unless --redis-url) and every service as a child
process, like TGI's launcher. Ready means a real generation went through. Once ready, a child
that dies is restarted (its requests survive: see design §6) up to --max-restarts times, then
everything stops with a clear message; a child that dies during start-up stops everything at
once. Ctrl-C or SIGTERM stops everything."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from services.launcher.embedded_redis import EmbeddedRedis
from shared.adapters import startup_refs
from shared.model_files import resolve_model_dir
from shared.openmp import IO_CPUS_ENV, cpu_list, share_cores, share_threads, split_cpus
from shared.redis_connect import redact_url
from shared.settings import Settings

log = logging.getLogger(__name__)

GROUP_SERVICES = ("worker", "scheduler")  # one of each per worker group

READY_TIMEOUT_S = 1800.0  # a first run may download the model


def die_with_parent(parent_pid: int) -> None:
    """In a child, before its program: SIGTERM when the launcher dies, even by SIGKILL (the
    OOM killer, `docker kill`; Linux's PR_SET_PDEATHSIG). A launcher that died before this
    ran is not there to signal: the child leaves at once."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def child_setup(cpus: set[int] | None) -> Callable[[], None]:
    """What a child runs before its program: die with the launcher; stay on `cpus` (its
    threads, OpenMP's included, inherit them, and libgomp sizes its pool to them)."""
    parent_pid = os.getpid()

    def setup() -> None:
        die_with_parent(parent_pid)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return setup


class Stop(Exception):
    """Raised by the signal handler to leave the wait loops."""


class Launcher:
    def __init__(self, settings: Settings, forwarded_args: list[str]) -> None:
        self.settings = settings
        self.forwarded_args = forwarded_args
        self.redis = EmbeddedRedis()
        self.children: dict[str, subprocess.Popen] = {}
        self.num_restarts = 0
        self.redis_url = ""
        # --worker-cpus: (the workers' CPUs, everyone else's); None: all share every CPU
        self.placement: tuple[set[int], set[int]] | None = None

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if self.settings.worker_cpus is not None:
            try:
                self.placement = split_cpus(self.settings.worker_cpus)
            except ValueError as exc:
                print(f"textgen: {exc}", file=sys.stderr, flush=True)
                return 2
            workers, others = self.placement
            log.info(
                "workers compute on CPUs %s; the other services run on %s",
                cpu_list(workers),
                cpu_list(others),
            )
        # once, before any child: a download or a missing model is one message (raised as
        # ModelNotFound to the CLI), not one traceback per service
        folder = resolve_model_dir(self.settings.model_id, self.settings.revision)
        # the same for --lora-adapters (AdapterError); the services check them again
        startup_refs(self.settings)
        log.info("model %s: %s", self.settings.model_id, folder)
        try:
            sentinels = self.settings.redis_sentinels
            url = self.redis_url = self.settings.redis_url or (
                ""
                if sentinels
                else self.redis.start(child_setup(self.placement[1] if self.placement else None))
            )
            for group in range(self.settings.num_groups):
                for service in GROUP_SERVICES:
                    self._spawn(self._child_name(service, group), url)
            self._spawn("gateway", url)
            self._wait_ready()
            print(
                f"textgen is ready: http://127.0.0.1:{self.settings.port} "
                f"(model {self.settings.model_id}, redis "
                f"{f'sentinels {sentinels}' if sentinels else redact_url(url)})",
                flush=True,
            )
            return self._watch()
        except Stop:
            print("textgen: stopping", file=sys.stderr, flush=True)
            return 0
        except ChildDied as died:
            print(f"textgen: {died}; stopping everything", file=sys.stderr, flush=True)
            return 1
        finally:
            self._stop_all()

    def _child_name(self, service: str, group: int) -> str:
        """ "worker", "scheduler" with one group; "worker-3", "scheduler-3" with several."""
        return service if self.settings.num_groups == 1 else f"{service}-{group}"

    def _command(self, name: str) -> list[str]:
        """The child's command line: the launch flags, and with several groups its --group
        (and --metrics-port + 2 * group, + 1 for the worker, so no two children share one)."""
        service, _, group = name.partition("-")
        command = [sys.executable, "-m", "services.launcher.cli", service, *self.forwarded_args]
        if group:
            command += ["--group", group]
        if self.settings.metrics_port and service != "gateway":
            offset = 2 * int(group or 0) + (service == "worker")
            command += ["--metrics-port", str(self.settings.metrics_port + offset)]
        return command

    def _spawn(self, name: str, redis_url: str) -> None:
        command = self._command(name)
        env = {**os.environ, "REDIS_URL": redis_url}  # secrets in the environment, not in `ps`
        if self.settings.api_key:
            env["API_KEY"] = self.settings.api_key
        is_worker = name.startswith("worker")
        if self.placement is None:
            cpus = None
            if is_worker and share_cores(env):
                log.info("%s shares its cores: GOMP_SPINCOUNT=%s", name, env["GOMP_SPINCOUNT"])
        else:
            workers, others = self.placement
            cpus = workers if is_worker else others
            if is_worker:  # its event loop moves to the others' once its torch thread exists
                env[IO_CPUS_ENV] = cpu_list(others)
        if is_worker:
            worker_cpus = self.placement[0] if self.placement else os.sched_getaffinity(0)
            processes = self.settings.num_groups * self.settings.num_shard
            threads = share_threads(env, len(worker_cpus), processes)
            if threads is not None:
                log.info(
                    "%s computes on %d threads: %d CPUs over %d worker processes",
                    name,
                    threads,
                    len(worker_cpus),
                    processes,
                )
        self.children[name] = subprocess.Popen(
            command, env=env, start_new_session=True, preexec_fn=child_setup(cpus)
        )
        log.info("started %s (pid %d)", name, self.children[name].pid)

    def _check_children(self) -> None:
        for name, child in self.children.items():
            code = child.poll()
            if code is not None:
                raise ChildDied(f"the {name} exited with code {code}", name)
        if not self.redis.is_alive():
            raise ChildDied("the embedded redis-server exited")

    def _wait_ready(self) -> None:
        base = f"http://127.0.0.1:{self.settings.port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_children()
            if _get_status(f"{base}/health") == 200 and self._generation_works(base):
                return
            time.sleep(0.25)
        raise ChildDied(f"no successful generation within {READY_TIMEOUT_S:.0f} s")

    def _generation_works(self, base: str) -> bool:
        body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 1}}).encode()
        headers = {"Content-Type": "application/json"}
        if self.settings.api_key:  # the probe is a client like any other
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        request = urllib.request.Request(f"{base}/generate", data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status == 200
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500 and exc.code != 429:  # no retry makes it pass
                detail = exc.read().decode(errors="replace")[:200]
                raise ChildDied(
                    f"the gateway refused the readiness probe: {exc.code} {detail}"
                ) from exc
            return False
        except (urllib.error.URLError, OSError):
            return False

    def _watch(self) -> int:
        while True:
            try:
                self._check_children()
            except ChildDied as died:
                if died.name is None or self.num_restarts >= self.settings.max_restarts:
                    raise
                self.num_restarts += 1
                print(
                    f"textgen: {died}; restarting it ({self.num_restarts}/"
                    f"{self.settings.max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
                self._spawn(died.name, self.redis_url)
            time.sleep(0.5)

    def _on_signal(self, signum, _frame) -> None:
        raise Stop()

    def _stop_all(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for child in self.children.values():
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + self.settings.shutdown_grace + 5
        for child in self.children.values():
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        self.redis.stop()


class ChildDied(Exception):
    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name  # the service that died; None for Redis or a start-up failure


def _get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0
