"""A user's model module that cannot be imported says why, in one line (issue 41 item 7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytrain.errors import ConfigError
from polytrain.models.contract import import_callable


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "import no_such_dependency_xyz\n",
            "module 'usermod_{n}' was found but importing it failed: ModuleNotFoundError: "
            "No module named 'no_such_dependency_xyz'",
        ),
        ("def build(spec) pass\n", "importing module 'usermod_{n}' raised SyntaxError"),
        ("raise RuntimeError('no GPU driver')\n", "raised RuntimeError: no GPU driver"),
    ],
)
def test_the_real_cause_is_named_and_chained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, message: str
) -> None:
    n = abs(hash(source)) % 10_000
    (tmp_path / f"usermod_{n}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        import_callable(f"usermod_{n}:build", "model.name")
    assert message.format(n=n) in str(info.value)
    assert "\n" not in str(info.value) and info.value.__cause__ is not None


def test_a_missing_module_still_says_check_the_spelling() -> None:
    with pytest.raises(
        ConfigError, match="cannot import module 'no_such_pkg_abc.models'.*spelling"
    ):
        import_callable("no_such_pkg_abc.models:make", "model.name")
