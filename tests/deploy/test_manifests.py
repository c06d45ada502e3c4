"""Structural checks of the deployment files (deploy/, Dockerfile, .dockerignore).

No Docker engine or cluster is needed: every YAML file is parsed with PyYAML and checked for
the mistakes that break a deployment at run time — a service without REDIS_URL, a worker group
with no scheduler (or two), a probe on the wrong port, an env name no Settings field reads, a
container running a `textgen` subcommand that does not exist, a kustomization pointing at a
missing file. The overlays are also rendered with `kubectl kustomize` (kubectl must be on PATH).
tests/deploy/test_validate.py runs the real Compose and the strict Kubernetes schemas.
"""

from __future__ import annotations

import functools
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from services.launcher.cli import COMMANDS
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose"
K8S = DEPLOY / "k8s"

SETTINGS_ENV = {name.upper() for name in Settings.model_fields}
# Read by libraries or the container runtime, not by Settings.
OTHER_ENV = {
    "HF_TOKEN",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "HF_HUB_ENABLE_HF_TRANSFER",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_DRIVER_CAPABILITIES",
    "OMP_NUM_THREADS",
    "GOMP_SPINCOUNT",
    "PYTHONUNBUFFERED",
}
DEFAULT_PORT = Settings.model_fields["port"].default
# Services that talk to Redis; `launch` starts its own.
REDIS_COMMANDS = {"gateway", "scheduler", "worker"}


# --- helpers -------------------------------------------------------------------------------------


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def load_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def deep_merge(base: Any, override: Any) -> Any:
    """Compose-style override: maps merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = deep_merge(base.get(key), value) if key in base else value
        return merged
    return override


def env_dict(env: Any) -> dict[str, Any]:
    """Compose `environment` as a map (it may be a list of KEY=VALUE or bare KEY)."""
    if env is None:
        return {}
    if isinstance(env, dict):
        return dict(env)
    return dict((item.split("=", 1) + [None])[:2] for item in env)


def as_argv(command: Any) -> list[str]:
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def textgen_subcommand(argv: list[str]) -> str | None:
    """The subcommand of an argv run under ENTRYPOINT ["textgen"] (or spelled out)."""
    if argv and argv[0] == "textgen":
        argv = argv[1:]
    return argv[0] if argv else None


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def load_compose(*names: str) -> dict[str, dict]:
    """Services of compose files merged in order, `extends` resolved."""
    merged: dict[str, Any] = {}
    for name in names:
        merged = deep_merge(merged, yaml.safe_load((COMPOSE / name).read_text()))
    services = merged["services"]
    for name, service in list(services.items()):
        extends = service.get("extends")
        if extends:
            source = yaml.safe_load((COMPOSE / extends.get("file", names[0])).read_text())
            base = source["services"][extends["service"]]
            rest = {k: v for k, v in service.items() if k != "extends"}
            services[name] = deep_merge(base, rest)
    return services


def dockerfile_stages() -> dict[str, list[str]]:
    """Stage name -> its lines (continuations joined), from ROOT/Dockerfile."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if match:
            current = stages.setdefault(match.group(2) or f"_{len(stages)}", [])
        if current is not None:
            current.append(line)
    return stages


def stage_closure(stages: dict[str, list[str]], target: str) -> set[str]:
    """The stages a target is built from (FROM parents and COPY --from sources)."""
    seen: set[str] = set()
    todo = [target]
    while todo:
        name = todo.pop()
        if name in seen or name not in stages:
            continue
        seen.add(name)
        for line in stages[name]:
            parent = re.match(r"FROM\s+(\S+)", line, re.IGNORECASE)
            if parent:
                todo.append(parent.group(1))
            todo += re.findall(r"--from=(\S+)", line)
    return seen


def kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def kustomize_objects(folder: Path) -> list[dict]:
    """The plain resources of a kustomization, following folder resources (no patches)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = folder / entry
        objects += kustomize_objects(path) if path.is_dir() else load_docs(path)
    return objects


def generated_config(folder: Path) -> dict[str, dict[str, str]]:
    """configMapGenerator literals of a kustomization and its bases, merged by name."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    maps: dict[str, dict[str, str]] = {}
    for entry in kustomization.get("resources", []):
        if (folder / entry).is_dir():
            for name, data in generated_config(folder / entry).items():
                maps.setdefault(name, {}).update(data)
    for generator in kustomization.get("configMapGenerator", []):
        data = dict(literal.split("=", 1) for literal in generator.get("literals", []))
        if generator.get("behavior") == "replace":
            maps[generator["name"]] = data
        else:
            maps.setdefault(generator["name"], {}).update(data)
    return maps


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o.get("kind") == kind}


def pod_templates(objects: list[dict]) -> list[dict]:
    return [
        o["spec"]["template"] for o in objects if o.get("kind") in ("Deployment", "StatefulSet")
    ]


def textgen_containers(objects: list[dict]) -> list[dict]:
    return [
        c
        for t in pod_templates(objects)
        for c in t["spec"]["containers"]
        if c["image"].split("/")[-1].startswith("textgen")
    ]


def container_env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def probe_port(probe: dict) -> Any:
    for kind in ("httpGet", "tcpSocket", "grpc"):
        if kind in probe:
            return probe[kind]["port"]
    return None


def resolve_port(container: dict, port: Any) -> int:
    """A named or numbered container port, as a number; fails when it is not declared."""
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    if isinstance(port, int):
        assert port in ports.values(), f"{container['name']}: port {port} not declared"
        return port
    assert port in ports, f"{container['name']}: no port named {port}"
    return ports[port]


@functools.cache
def base_objects() -> list[dict]:
    return kustomize_objects(K8S / "base")


@functools.cache
def base_config() -> dict[str, dict[str, str]]:
    return generated_config(K8S / "base")


# --- every file ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    assert load_docs(path), f"{path} is empty"


def test_deploy_has_compose_and_kustomize() -> None:
    assert (COMPOSE / "compose.yaml").is_file()
    assert (COMPOSE / "compose.gpu.yaml").is_file()
    assert (K8S / "base" / "kustomization.yaml").is_file()
    for overlay in ("cpu", "gpu"):
        assert (K8S / "overlays" / overlay / "kustomization.yaml").is_file()


# --- Dockerfile ----------------------------------------------------------------------------------


def test_dockerfile_targets_run_textgen_as_non_root() -> None:
    stages = dockerfile_stages()
    for target in ("gateway", "worker"):
        assert target in stages, f"Dockerfile has no `{target}` target"
        lines = stages[target]
        assert any(re.fullmatch(r'ENTRYPOINT \["textgen"\]', line) for line in lines), target
        users = [line.split()[1] for line in lines if line.upper().startswith("USER ")]
        assert users and users[-1].split(":")[0] not in ("root", "0"), f"{target} runs as root"
        # Numeric, so Kubernetes can verify runAsNonRoot.
        assert users[-1].split(":")[0].isdigit()


def test_gateway_image_has_no_torch() -> None:
    stages = dockerfile_stages()
    gateway_lines = [line for name in stage_closure(stages, "gateway") for line in stages[name]]
    for line in gateway_lines:
        assert "optional-dependencies" not in line and "[worker]" not in line, line
        assert "TORCH_INDEX_URL" not in line, line
    worker_lines = [line for name in stage_closure(stages, "worker") for line in stages[name]]
    assert any("[worker]" in line or "optional-dependencies" in line for line in worker_lines)


def test_dockerignore_keeps_the_source() -> None:
    patterns = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".git"} <= patterns
    assert not patterns & {"shared", "services", "pyproject.toml", "*"}


# --- compose -------------------------------------------------------------------------------------

COMPOSE_PROJECTS = [
    ("compose.yaml",),
    ("compose.yaml", "compose.gpu.yaml"),
    ("compose.yaml", "compose.group1.yaml"),
    ("compose.yaml", "compose.redis-ha.yaml"),
]


def compose_projects() -> list[tuple[str, ...]]:
    return [p for p in COMPOSE_PROJECTS if all((COMPOSE / n).is_file() for n in p)]


def textgen_services(services: dict[str, dict]) -> dict[str, tuple[str, dict]]:
    """name -> (subcommand, service) for services running a textgen image."""
    out = {}
    for name, service in services.items():
        if "build" in service or str(service.get("image", "")).startswith("textgen"):
            out[name] = (textgen_subcommand(as_argv(service.get("command"))), service)
    return out


@pytest.mark.parametrize("files", compose_projects(), ids="+".join)
def test_compose_services(files: tuple[str, ...]) -> None:
    services = load_compose(*files)
    runs = textgen_services(services)
    assert {cmd for cmd, _ in runs.values()} >= {"gateway", "scheduler", "worker"}
    stages = dockerfile_stages()
    shared_env: dict[str, set] = {"REDIS_URL": set(), "NAMESPACE": set(), "MODEL_ID": set()}
    for name, (cmd, service) in runs.items():
        assert cmd in COMMANDS, f"{name}: `textgen {cmd}` is not a subcommand"
        env = env_dict(service.get("environment"))
        unknown = set(env) - SETTINGS_ENV - OTHER_ENV
        assert not unknown, f"{name}: env {unknown} is read by no Settings field"
        if cmd in REDIS_COMMANDS:
            assert env.get("REDIS_URL"), f"{name} has no REDIS_URL"
            host = urlparse(env["REDIS_URL"]).hostname
            assert host in services, f"{name}: REDIS_URL host {host} is not a compose service"
            assert "redis" in str(service.get("depends_on", "")), f"{name} starts before redis"
        for key, values in shared_env.items():
            values.add(env.get(key))
        assert "healthcheck" in service, f"{name} has no healthcheck"
        target = service["build"]["target"] if isinstance(service.get("build"), dict) else None
        if target:
            assert target in stages, f"{name}: build target {target} not in the Dockerfile"
            assert target == ("worker" if cmd == "worker" else "gateway"), name
        for volume in service.get("volumes", []):
            if ":/models" in volume:
                assert volume.endswith(":ro"), f"{name}: /models must be read-only"
            source = volume.split(":")[0]
            if not source.startswith((".", "/", "$")):
                assert source in yaml.safe_load((COMPOSE / files[0]).read_text())["volumes"]
    for key, values in shared_env.items():
        assert len(values) == 1, f"services disagree on {key}: {values}"


@pytest.mark.parametrize("files", compose_projects(), ids="+".join)
def test_compose_worker_groups_pair_up(files: tuple[str, ...]) -> None:
    """Every group has exactly one worker and exactly one scheduler."""
    groups: dict[str, dict[str, list[str]]] = {}
    for name, (cmd, service) in textgen_services(load_compose(*files)).items():
        if cmd in ("worker", "scheduler"):
            group = env_dict(service.get("environment")).get("GROUP")
            assert isinstance(group, str), f"{name}: GROUP must be a quoted string, got {group!r}"
            groups.setdefault(group, {"worker": [], "scheduler": []})[cmd].append(name)
            port = env_dict(service["environment"]).get("METRICS_PORT")
            assert port and str(port) in str(service["healthcheck"]["test"]), name
    assert groups
    for group, members in groups.items():
        assert len(members["worker"]) == 1 and len(members["scheduler"]) == 1, (group, members)


def test_compose_gateway_publishes_its_port() -> None:
    services = load_compose("compose.yaml")
    gateways = [s for cmd, s in textgen_services(services).values() if cmd == "gateway"]
    assert gateways
    for gateway in gateways:
        port = int(env_dict(gateway.get("environment")).get("PORT") or DEFAULT_PORT)
        published = [str(p).rsplit(":", 1)[-1].split("/")[0] for p in gateway.get("ports", [])]
        assert str(port) in published, f"gateway listens on {port}, publishes {published}"
        assert str(port) in str(gateway["healthcheck"]["test"])
        assert "/health" in str(gateway["healthcheck"]["test"])
        # Docker sets HOSTNAME (the container id), which the bind-address setting would read.
        assert flag_value(as_argv(gateway["command"]), "--hostname") == "0.0.0.0"


def test_compose_gpu_override_reserves_a_gpu() -> None:
    worker = load_compose("compose.yaml", "compose.gpu.yaml")["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)
    assert str(env_dict(worker["environment"]).get("DEVICE")).startswith("cuda")
    args = worker["build"].get("args", {})
    declared = {
        line.split()[1].split("=")[0]
        for lines in dockerfile_stages().values()
        for line in lines
        if line.startswith("ARG ")
    }
    assert set(args) <= declared, f"build args {set(args) - declared} not declared in Dockerfile"


# --- kustomize -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: str(p.parent.relative_to(K8S)))
def test_kustomization_references_exist(path: Path) -> None:
    kustomization = yaml.safe_load(path.read_text())
    assert kustomization.get("kind") == "Kustomization"
    assert "namespace" not in kustomization or "base" not in path.parts
    folder = path.parent
    for entry in kustomization.get("resources", []) + kustomization.get("components", []):
        target = folder / entry
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"missing {entry}"
    for patch in kustomization.get("patches", []) + kustomization.get("patchesStrategicMerge", []):
        file = patch.get("path") if isinstance(patch, dict) else patch
        if file:
            assert (folder / file).is_file(), f"missing patch {file}"
    for generator in kustomization.get("configMapGenerator", []):
        for file in generator.get("envs", []) + generator.get("files", []):
            assert (folder / file.split("=")[-1]).is_file(), f"missing {file}"
        keys = {literal.split("=", 1)[0] for literal in generator.get("literals", [])}
        unknown = keys - SETTINGS_ENV - OTHER_ENV
        assert not unknown, f"{generator['name']}: {unknown} are read by no Settings field"


def test_base_is_namespace_less() -> None:
    for obj in base_objects():
        assert "namespace" not in obj["metadata"], obj["metadata"]["name"]


def test_base_containers_run_textgen_with_settings() -> None:
    containers = textgen_containers(base_objects())
    assert containers
    for container in containers:
        assert "command" not in container, "keep the image's ENTRYPOINT [textgen]; use args"
        cmd = textgen_subcommand(as_argv(container.get("args")))
        assert cmd in COMMANDS, f"{container['name']}: `textgen {cmd}` is not a subcommand"
        assert cmd == container["name"], f"container {container['name']} runs `textgen {cmd}`"
        env = container_env(container)
        unknown = set(env) - SETTINGS_ENV - OTHER_ENV
        assert not unknown, f"{container['name']}: env {unknown} is read by no Settings field"
        config_refs = [
            e["configMapRef"]["name"] for e in container.get("envFrom", []) if "configMapRef" in e
        ]
        for ref in config_refs:
            assert ref in base_config() or ref in by_kind(base_objects(), "ConfigMap"), ref
        if cmd in REDIS_COMMANDS:
            assert "REDIS_URL" in env or any(
                "REDIS_URL" in base_config().get(ref, {}) for ref in config_refs
            ), f"{container['name']} gets no REDIS_URL"


def test_base_redis_url_points_at_a_service() -> None:
    services = by_kind(base_objects(), "Service")
    for name, data in base_config().items():
        if "REDIS_URL" in data:
            assert urlparse(data["REDIS_URL"]).hostname in services, name


def test_worker_statefulset_pairs_worker_and_scheduler() -> None:
    statefulsets = by_kind(base_objects(), "StatefulSet")
    assert len(statefulsets) == 1
    sts = next(iter(statefulsets.values()))
    containers = {c["name"]: c for c in sts["spec"]["template"]["spec"]["containers"]}
    assert {"worker", "scheduler"} <= set(containers)
    worker, scheduler = containers["worker"], containers["scheduler"]
    group = container_env(worker)["GROUP"]
    assert group == container_env(scheduler)["GROUP"], "worker and scheduler disagree on GROUP"
    assert group["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Same pod, same network: the two metrics servers need two ports, and probes hit them.
    ports = {}
    for name, container in (("worker", worker), ("scheduler", scheduler)):
        ports[name] = int(container_env(container)["METRICS_PORT"]["value"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in container, f"{name} has no {probe}"
            assert resolve_port(container, probe_port(container[probe])) == ports[name]
    assert ports["worker"] != ports["scheduler"]
    # The scheduler runs on the torch-free image.
    gateway_images = {
        c["image"] for c in textgen_containers(base_objects()) if c["name"] == "gateway"
    }
    assert scheduler["image"] in gateway_images
    assert worker["image"] not in gateway_images
    service = by_kind(base_objects(), "Service").get(sts["spec"]["serviceName"])
    assert service and service["spec"].get("clusterIP") == "None", "needs a headless Service"


def test_gateway_deployment_service_and_hpa() -> None:
    deployments = by_kind(base_objects(), "Deployment")
    gateway_deployments = [
        d
        for d in deployments.values()
        if any(c["name"] == "gateway" for c in d["spec"]["template"]["spec"]["containers"])
    ]
    assert len(gateway_deployments) == 1
    deployment = gateway_deployments[0]
    container = next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"
    )
    env = container_env(container)
    port = int(env["PORT"]["value"]) if "PORT" in env else DEFAULT_PORT
    assert resolve_port(container, "http" if "http" in str(container["ports"]) else port) == port
    # Kubernetes sets HOSTNAME (the pod name), which the bind-address setting would read.
    assert flag_value(as_argv(container["args"]), "--hostname") == "0.0.0.0"
    for probe in ("livenessProbe", "readinessProbe"):
        assert resolve_port(container, probe_port(container[probe])) == port
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = [
        s
        for s in by_kind(base_objects(), "Service").values()
        if s["spec"]["selector"].items() <= labels.items()
    ]
    assert services, "no Service selects the gateway pods"
    assert any(
        resolve_port(container, p["targetPort"]) == port for p in services[0]["spec"]["ports"]
    )
    hpas = by_kind(base_objects(), "HorizontalPodAutoscaler")
    targets = [h["spec"]["scaleTargetRef"] for h in hpas.values()]
    assert {"kind": "Deployment", "name": deployment["metadata"]["name"]}.items() <= targets[
        0
    ].items()
    hpa = next(iter(hpas.values()))
    assert any(m.get("resource", {}).get("name") == "cpu" for m in hpa["spec"]["metrics"])
    assert container["resources"]["requests"]["cpu"], "CPU utilization needs a CPU request"


def test_selectors_match_pods() -> None:
    labels = [t["metadata"]["labels"] for t in pod_templates(base_objects())]
    for obj in base_objects():
        kind = obj["kind"]
        if kind == "Service":
            selector = obj["spec"]["selector"]
        elif kind in ("PodDisruptionBudget", "Deployment", "StatefulSet"):
            selector = obj["spec"]["selector"]["matchLabels"]
        else:
            continue
        assert any(selector.items() <= pod_labels.items() for pod_labels in labels), (
            f"{kind} {obj['metadata']['name']}"
        )
    pdbs = by_kind(base_objects(), "PodDisruptionBudget")
    assert any("worker" in name for name in pdbs), "the worker StatefulSet needs a PDB"


def test_gpu_overlay_requests_a_gpu() -> None:
    overlay = K8S / "overlays" / "gpu"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    patches = [
        doc
        for patch in kustomization.get("patches", [])
        for doc in load_docs(overlay / patch["path"])
    ]
    sts = next(p for p in patches if p["kind"] == "StatefulSet")
    spec = sts["spec"]["template"]["spec"]
    worker = next(c for c in spec["containers"] if c["name"] == "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", []))
    images = {i["name"]: i for i in kustomization["images"]}
    cpu = yaml.safe_load((K8S / "overlays" / "cpu" / "kustomization.yaml").read_text())
    cpu_images = {i["name"]: i for i in cpu["images"]}
    assert images["textgen-worker"] != cpu_images["textgen-worker"], "GPU overlay needs GPU image"
    assert generated_config(overlay)["textgen-config"]["DEVICE"].startswith("cuda")
    assert generated_config(K8S / "overlays" / "cpu")["textgen-config"]["DEVICE"] == "cpu"


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_overlay_renders(overlay: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not on PATH: it renders the kustomize overlays (CI has it)")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rendered.returncode == 0, rendered.stderr
    objects = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    config_maps = by_kind(objects, "ConfigMap")
    for container in textgen_containers(objects):
        for ref in container.get("envFrom", []):
            assert ref["configMapRef"]["name"] in config_maps
        assert ":" in container["image"], f"{container['name']}: image without a tag"
    sts = next(iter(by_kind(objects, "StatefulSet").values()))
    worker = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "worker")
    gpus = worker["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert (gpus is not None) == (overlay == "gpu")
