"""The layering rules of docs/architecture.md, enforced by scanning imports; and its layout
block checked against the files that exist."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "polytrain"

# Modules that must run without torch (planner, schedules, consistency rules, topology).
PURE = [
    "topology.py",
    "errors.py",
    "pipeline/schedule",
    "pipeline/partition.py",
    "pipeline/stage_costs.py",
    "planner",
    "ps/sharding.py",
    "ps/consistency.py",
    "gossip/graphs.py",
    "scheduler",  # policies and simulator pure; executors drive the trainer through its CLI
]
# Modules of strategy families that are pure and that the planner reads: it simulates the same
# schedule action lists, partitions and peer graphs the runtime uses (ARCHITECTURE.md).
PLANNER_READS = {
    "polytrain.pipeline.schedule",
    "polytrain.pipeline.partition",
    "polytrain.gossip.graphs",
}
# The only places that call c10d directly.
C10D_ALLOWED = ["comm", "launch", "testing", "_torch_private.py"]  # the last: torch private APIs
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
# Strategy packages, present and planned (ARCHITECTURE.md's target layering): they import
# `core` and lower layers, never `trainer` (which picks them from its family table) or `cli`.
STRATEGY_PACKAGES = {"parallel", "pipeline", "ps", "gossip", "hybrid", "spatial"}
# `testing` runs whole jobs (testing/jobs.py -> trainer) and is imported by nothing below it
# but `measure` (its multi-process harness times calibration probes).
ABOVE_STRATEGIES = {"trainer", "cli", "scheduler", "measure", "testing"}
# package -> packages it must not import (lower layers never import higher ones).
FORBIDDEN = {
    "comm": {"core", "config", *ABOVE_STRATEGIES, *STRATEGY_PACKAGES, "planner"},
    "config": {"core", "comm", *ABOVE_STRATEGIES, *STRATEGY_PACKAGES},
    "data": {"core", *ABOVE_STRATEGIES, *STRATEGY_PACKAGES},
    "models": {"core", *ABOVE_STRATEGIES, *STRATEGY_PACKAGES},
    "observe": {"core", *ABOVE_STRATEGIES, *STRATEGY_PACKAGES},
    "core": {*ABOVE_STRATEGIES, *STRATEGY_PACKAGES, "planner"},
    "planner": {*ABOVE_STRATEGIES, "measure", "core", "models", "data", "comm", "config"},
    **{package: ABOVE_STRATEGIES for package in STRATEGY_PACKAGES},
    "trainer": {"cli", "scheduler", "testing"},
    "measure": {"trainer", "cli", "scheduler"},
    "testing": {"cli", "scheduler", "measure"},
}


def _sources(rel: str) -> list[Path]:
    path = PACKAGE / rel
    return sorted(path.rglob("*.py")) if path.is_dir() else ([path] if path.exists() else [])


def _module_name(path: Path) -> list[str]:
    parts = ["polytrain", *path.relative_to(PACKAGE).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every import statement in ``path`` (relative ones resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
            if node.level == 0:
                out.append((node.module or "", names))
                continue
            package = _module_name(path)
            if path.name != "__init__.py":
                package = package[:-1]
            base = package[: len(package) - (node.level - 1)]
            out.append((".".join([*base, *([node.module] if node.module else [])]), names))
    return out


def _function_level_imports(path: Path) -> list[str]:
    """polytrain modules imported inside a function or under ``if TYPE_CHECKING`` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    hiding = (ast.FunctionDef, ast.AsyncFunctionDef, ast.If)
    for scope in ast.walk(tree):
        if not isinstance(scope, hiding):
            continue
        for node in ast.walk(scope):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("polytrain"):
                found.append(f"{_rel(path)}:{node.lineno} {node.module}")
    return sorted(set(found))


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


@pytest.mark.parametrize("rel", PURE)
def test_pure_modules_import_no_torch(rel: str) -> None:
    for path in _sources(rel):
        for module, _ in _imports(path):
            assert module.split(".")[0] not in {"torch", "numpy"}, f"{_rel(path)} imports {module}"


def test_the_planner_reads_only_pure_family_modules() -> None:
    """The planner never imports a family's runtime or the measuring package: only the pure
    modules it prices by simulation (``PLANNER_READS``)."""
    offenders = []
    for path in _sources("planner"):
        for module, _names in _imports(path):
            parts = module.split(".")
            if parts[0] != "polytrain" or len(parts) < 2 or parts[1] not in STRATEGY_PACKAGES:
                continue
            if not any(module == m or module.startswith(m + ".") for m in PLANNER_READS):
                offenders.append(f"{_rel(path)} imports {module}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.slow  # a fresh interpreter
def test_importing_the_planner_loads_no_torch() -> None:
    modules = sorted(
        ".".join(_module_name(path)) for path in _sources("planner") if path.suffix == ".py"
    )
    code = f"import sys; import {', '.join(modules)}; assert 'torch' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


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


# Strategy families that exist: siblings that never import each other (what two need lives in
# `core`: batchnorm, recompute, compile, the micro-batch loop, tensor parallelism).
FAMILIES = ["parallel", "pipeline", "ps", "gossip"]


def _cross_family_imports() -> set[str]:
    found = set()
    for family in FAMILIES:
        for path in _sources(family):
            for module, names in _imports(path):
                parts = module.split(".")
                if parts[0] != "polytrain":
                    continue
                targets = names if len(parts) == 1 else [parts[1]]  # from polytrain import ps
                if any(t in FAMILIES and t != family for t in targets):
                    found.add(f"{_rel(path)} -> {module}")
    return found


def test_strategy_families_do_not_import_each_other() -> None:
    found = sorted(_cross_family_imports())
    assert not found, (
        "a strategy family imports another (move what both need into core):\n" + "\n".join(found)
    )


def test_strategy_packages_never_import_the_trainer() -> None:
    """The rule that matters most for the next families: a strategy imports down only."""
    assert FORBIDDEN["pipeline"] >= {"trainer", "cli"}
    assert FORBIDDEN["ps"] >= {"trainer", "cli"}
    assert FORBIDDEN["parallel"] >= {"trainer", "cli"}
    assert FORBIDDEN["core"] >= STRATEGY_PACKAGES | {"trainer"}


def test_no_imports_hidden_in_functions() -> None:
    """Cycles are fixed by layering, not dodged with imports inside functions; only the CLI
    defers importing a sub-command's module until that command runs (start-up time)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _rel(path).split("/")[0] != "cli":
            offenders += _function_level_imports(path)
    assert not offenders, "imports inside functions:\n" + "\n".join(offenders)


# -- docs/architecture.md's layout block ------------------------------------------------------

_PLANNED = "(planned)"
_NAME = re.compile(r"^[A-Za-z_][\w.]*/?$")


def _layout_entries() -> list[tuple[str, bool]]:
    """(path under src/polytrain, marked planned) for every entry of the layout block.

    An entry line is indented 2 (a top-level module or package) or 4 (inside the package above)
    and starts with one or more names ending in ``/`` or ``.py``; deeper lines continue the
    description. ``(planned)`` right after the names marks something that does not exist yet.
    """
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    entries: list[tuple[str, bool]] = []
    parent = ""
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if indent not in (2, 4) or not line.strip():
            continue
        words = line.split()
        names = []
        for word in words:
            if not (_NAME.match(word) and (word.endswith("/") or word.endswith(".py"))):
                break
            names.append(word)
        rest = " ".join(words[len(names) :])
        planned = rest.startswith(_PLANNED)
        for name in names:
            path = name if indent == 2 else parent + name
            entries.append((path.rstrip("/"), planned))
        if indent == 2 and names:
            parent = names[-1]
    return entries


def test_layout_block_parses() -> None:
    entries = dict(_layout_entries())
    assert {"topology.py", "core", "trainer", "pipeline/schedule"} <= set(entries)


def test_layout_lists_what_exists() -> None:
    """Every entry not marked planned exists, and every top-level module and package is listed."""
    entries = _layout_entries()
    missing = [p for p, planned in entries if not planned and not (PACKAGE / p).exists()]
    assert not missing, (
        f"docs/architecture.md lists {missing}, which do not exist: mark them (planned)"
    )
    listed = {p for p, _ in entries}
    present = {
        p.name
        for p in PACKAGE.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and not p.name.startswith("_"))
    }
    unlisted = sorted(present - listed)
    assert not unlisted, f"src/polytrain/{unlisted} are missing from docs/architecture.md's layout"
