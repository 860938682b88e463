"""``polytrain train --strategy auto``: the planner's choice, printed, is the job that runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from tests.helpers.cli import run_main


def test_auto_dry_run_prints_the_choice_and_a_manual_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    monkeypatch.setenv("POLYTRAIN_CACHE", str(tmp_path / "cache"))  # no profile: catalog
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--strategy", "auto", "--model", "mlp", "--data", str(corpus)]
    code, out, err = run_main([*argv, "--nproc", "2", "--dry-run"], capsys)
    assert code == 0, err
    first, _, toml_text = out.partition("\n")
    assert first.startswith("polytrain: planner chose ") and "catalog figures" in first
    job = tomllib.loads(toml_text)
    assert job["strategy"] == "manual"
    assert 1 <= job["launch"]["nproc"] <= 2
