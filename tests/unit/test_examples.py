"""Every job file in examples/ resolves and passes pre-flight as written (`--dry-run`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from tests.helpers.cli import run_main

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_example_validates_as_written(
    path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths in the job land here, not in the checkout
    code, out, err = run_main(["train", "--config", str(path), "--dry-run"], capsys)
    assert code == 0, err
    assert tomllib.loads(out)["model"]["name"]
