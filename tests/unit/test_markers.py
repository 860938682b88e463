"""`pytest -m "not slow"` is the developers' fast loop: every multi-process or end-to-end test
must carry the ``slow`` marker, or the fast loop silently grows into the whole suite."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

# Names whose use makes a test multi-process or end to end.
SPAWNING = {"run_distributed", "run_job", "subprocess", "multiprocessing", "mp", "Popen"}

# Modules that may spawn without the marker, and why they stay fast.
ALLOWED = {
    "unit/test_ps_pure.py": "one fresh interpreter that imports polytrain.ps (about a second)",
}


def _is_slow_mark(node: ast.expr) -> bool:
    return ast.unparse(node).replace(" ", "") in {"pytest.mark.slow", "slow"}


def _module_is_slow(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            marks = node.value.elts if isinstance(node.value, ast.List) else [node.value]
            if any(_is_slow_mark(m) for m in marks):
                return True
    return False


def _names(node: ast.AST) -> set[str]:
    return {
        n.id if isinstance(n, ast.Name) else n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Name | ast.Attribute)
    }


def _unmarked_spawning_tests(path: Path, root: Path = TESTS) -> list[str]:
    tree = ast.parse(path.read_text())
    if _module_is_slow(tree):
        return []
    helpers = {
        f.name
        for f in tree.body
        if isinstance(f, ast.FunctionDef)
        and not f.name.startswith("test_")
        and _names(f) & SPAWNING
    }
    found = []
    for f in tree.body:
        if not (isinstance(f, ast.FunctionDef) and f.name.startswith("test_")):
            continue
        if any(_is_slow_mark(d) for d in f.decorator_list):
            continue
        if _names(f) & (SPAWNING | helpers):
            found.append(f"{path.relative_to(root)}::{f.name}")
    return found


def test_every_multi_process_test_is_marked_slow() -> None:
    modules = sorted(TESTS.rglob("test_*.py"))
    assert len(modules) > 20  # the scan sees the suite
    unmarked = [
        name
        for path in modules
        if str(path.relative_to(TESTS)) not in ALLOWED
        for name in _unmarked_spawning_tests(path)
    ]
    assert unmarked == [], f"mark these @pytest.mark.slow: {unmarked}"


def test_every_distributed_module_is_marked_slow() -> None:
    unmarked = [
        str(p.relative_to(TESTS))
        for p in sorted((TESTS / "distributed").glob("test_*.py"))
        if not _module_is_slow(ast.parse(p.read_text()))
    ]
    assert unmarked == [], f"add `pytestmark = pytest.mark.slow` to {unmarked}"


def test_the_scan_finds_an_unmarked_spawning_test(tmp_path: Path) -> None:
    module = tmp_path / "test_example.py"
    module.write_text(
        "import pytest\n"
        "from polytrain.testing import run_distributed\n"
        "def _helper():\n    return run_distributed(print, 2)\n"
        "def test_direct():\n    run_distributed(print, 2)\n"
        "def test_through_helper():\n    _helper()\n"
        "@pytest.mark.slow\ndef test_marked():\n    run_distributed(print, 2)\n"
        "def test_pure():\n    assert True\n"
    )
    found = _unmarked_spawning_tests(module, tmp_path)
    assert found == ["test_example.py::test_direct", "test_example.py::test_through_helper"]
    module.write_text("import pytest\npytestmark = pytest.mark.slow\n" + module.read_text())
    assert _unmarked_spawning_tests(module, tmp_path) == []
