"""The layering rules of docs/architecture.md, enforced by scanning imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "polytrain"

# Modules that must run without torch (planner, schedules, consistency rules, topology).
PURE = [
    "topology.py",
    "errors.py",
    "pipeline/schedule",
    "pipeline/partition.py",
    "planner",
    "ps/sharding.py",
    "ps/consistency.py",
]
# The planner's torch-facing modules (ARCHITECTURE: model statistics and host calibration).
TORCH_FACING = {"planner/stats.py", "planner/calibrate.py"}
# The only places that call c10d directly.
C10D_ALLOWED = ["comm", "launch", "testing"]
# torch.distributed sub-packages that strategies may build on.
TORCH_STRATEGY_PACKAGES = {
    "fsdp",
    "tensor",
    "checkpoint",
    "pipelining",
    "device_mesh",
    "algorithms",
    "elastic",
    "launcher",
    "_composable",
    "nn",
}
# package -> packages it must not import (lower layers never import higher ones).
FORBIDDEN = {
    "comm": {"trainer", "cli", "parallel", "pipeline", "ps", "gossip", "scheduler", "planner"},
    "config": {"trainer", "cli", "comm", "parallel", "pipeline", "ps"},
    "data": {"trainer", "cli", "parallel", "pipeline", "ps"},
    "models": {"trainer", "cli", "parallel", "pipeline", "ps"},
    "parallel": {"trainer", "cli"},
    "pipeline": {"cli"},
    "ps": {"cli"},
    "trainer": {"cli"},
}


def _sources(rel: str) -> list[Path]:
    path = PACKAGE / rel
    return sorted(path.rglob("*.py")) if path.is_dir() else ([path] if path.exists() else [])


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every import statement in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [alias.name for alias in node.names]))
    return out


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


@pytest.mark.parametrize("rel", PURE)
def test_pure_modules_import_no_torch(rel: str) -> None:
    for path in _sources(rel):
        if _rel(path) in TORCH_FACING:
            continue
        for module, _ in _imports(path):
            assert module.split(".")[0] not in {"torch", "numpy"}, f"{_rel(path)} imports {module}"


def _uses_c10d(module: str, names: list[str]) -> bool:
    if module == "torch.distributed":
        return not names or any(n not in TORCH_STRATEGY_PACKAGES for n in names)
    return module == "torch" and "distributed" in names


def test_only_comm_launch_testing_call_c10d() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        top = _rel(path).split("/")[0]
        if top in C10D_ALLOWED:
            continue
        for module, names in _imports(path):
            if _uses_c10d(module, names):
                offenders.append(f"{_rel(path)}: {module} {names}")
    assert not offenders, "c10d used outside comm/launch/testing:\n" + "\n".join(offenders)


def test_lower_layers_do_not_import_higher_ones() -> None:
    offenders = []
    for package, forbidden in FORBIDDEN.items():
        for path in _sources(package):
            for module, _ in _imports(path):
                parts = module.split(".")
                if parts[0] == "polytrain" and len(parts) > 1 and parts[1] in forbidden:
                    offenders.append(f"{_rel(path)} imports {module}")
    assert not offenders, "\n".join(offenders)
