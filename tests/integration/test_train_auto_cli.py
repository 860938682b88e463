"""``polytrain train --strategy auto``: the planner's choice, printed, is the job that runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib


@pytest.mark.slow
def test_auto_dry_run_prints_the_choice_and_a_manual_job(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    env = {**os.environ, "POLYTRAIN_CACHE": str(tmp_path / "cache")}  # no profile: catalog
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "polytrain.cli.app",
            "train",
            "--strategy",
            "auto",
            "--model",
            "mlp",
            "--data",
            str(corpus),
            "--nproc",
            "2",
            "--dry-run",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    first, _, toml_text = proc.stdout.partition("\n")
    assert first.startswith("polytrain: planner chose ") and "catalog figures" in first
    job = tomllib.loads(toml_text)
    assert job["strategy"] == "manual"
    assert 1 <= job["launch"]["nproc"] <= 2
