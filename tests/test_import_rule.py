"""The import rule. The running services (gateway, scheduler, worker) import `shared`, never
each other, so each can be deployed and scaled alone; the composers put services together in
one process: the launcher (its CLI dispatches to each service, and it starts them all), the
in-process engine (scheduler and worker by direct calls) and the bench (it launches the
server and runs the engine beside it). `shared` imports no service. The gateway and the
scheduler never import torch (checked on the source, and by importing them in a clean
interpreter)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVICES = sorted(p.name for p in (REPO / "services").iterdir() if (p / "__init__.py").exists())


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


RUNNING = {"gateway", "scheduler", "worker"}  # deployed alone: they import only `shared`
COMPOSERS = {  # what each composer may import besides itself and `shared`
    "launcher": RUNNING | {"bench"},  # `textgen bench` is one of its commands
    "engine": {"scheduler", "worker"},
    "bench": {"engine", "launcher"},
}


def test_services_import_only_shared_and_what_they_compose():
    assert set(SERVICES) == RUNNING | set(COMPOSERS)  # a new package states its place here
    offenders = []
    for service in SERVICES:
        allowed = {service} | COMPOSERS.get(service, set())
        for path in (REPO / "services" / service).rglob("*.py"):
            for name in imported_modules(path):
                parts = name.split(".")
                if parts[0] == "services" and len(parts) > 1 and parts[1] not in allowed:
                    offenders.append(f"{path.relative_to(REPO)} imports {name}")
    assert offenders == []


def test_shared_imports_no_service():
    offenders = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in (REPO / "shared").rglob("*.py")
        for name in imported_modules(path)
        if name.split(".")[0] == "services"
    ]
    assert offenders == []


def test_gateway_and_scheduler_do_not_load_torch():
    code = (
        "import sys\n"
        "import services.gateway.app, services.gateway.main\n"
        "import services.scheduler.service, services.scheduler.main\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
