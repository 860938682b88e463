"""Through the ``polytrain`` command: a PS async worker killed mid-run does not stop training.

Starts ``polytrain train --sync ps --ps-mode async`` with 4 ranks (rank 3 the server, 0-2
workers), waits until rank 0 has logged step 5, SIGKILLs worker rank 2 (found as a child of the
launcher in /proc, by its ``RANK`` environment variable), and checks that the launcher warns once,
keeps the others running, and exits 0 after the last step. See [Note: tolerated worker deaths]
in launch/tolerant.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polytrain.config import job_from_dict
from polytrain.launch.local import tolerated_ranks
from polytrain.testing import scaled

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
STEPS = 1500


def worker_of_rank(launcher: int, rank: int) -> int | None:
    """Pid of the launcher's child process whose environment has ``RANK=<rank>``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def last_step(metrics: Path) -> int:
    if not metrics.exists():
        return -1
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line]
    return max(steps, default=-1)


def test_tolerated_ranks_are_ps_async_workers_but_rank_0() -> None:
    def job(**ps: object) -> list[int]:
        return tolerated_ranks(
            job_from_dict(
                {
                    "parallel": {"sync": "ps"},
                    "ps": {"servers": 2, **ps},
                    "launch": {"nproc": 6},
                    "train": {"global_batch_size": 12},
                }
            )
        )

    assert job(mode="async") == [1, 2, 3]
    assert job(mode="ssp", staleness=1) == [1, 2, 3]
    assert job(mode="sync") == []
    assert tolerated_ranks(job_from_dict({})) == []


def run_and_kill(tmp_path: Path, rank: int) -> tuple[subprocess.Popen[str], str, str, int]:
    """Start the async run, SIGKILL ``rank`` once rank 0 logged step 5; (launcher, out, err, step)."""
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [
            *(sys.executable, "-m", "polytrain.cli.app", "train", "--model", "mlp"),
            *("--sync", "ps", "--ps-mode", "async", "--ps-servers", "1", "--nproc", "4"),
            *("--steps", str(STEPS), "--batch-size", "12", "--no-progress"),
            *("--out-dir", str(out), "--set", "observe.log_every=1"),
        ],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + scaled(60)
        while last_step(metrics) < 5:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "rank 0 never reached step 5"
            time.sleep(0.05)
        victim = worker_of_rank(launcher.pid, rank)
        assert victim is not None, f"rank {rank} not found among the launcher's children"
        os.kill(victim, signal.SIGKILL)
        killed_at = last_step(metrics)
        stdout, stderr = launcher.communicate(timeout=scaled(120))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    return launcher, stdout, stderr, killed_at


def test_async_run_survives_killed_worker(tmp_path: Path) -> None:
    launcher, stdout, stderr, killed_at = run_and_kill(tmp_path, rank=2)
    assert killed_at < STEPS - 100  # killed well before the end
    assert launcher.returncode == 0, stderr
    assert last_step(tmp_path / "run" / "metrics.jsonl") == STEPS
    warnings = [line for line in stderr.splitlines() if "worker rank 2 died" in line]
    assert len(warnings) == 1, stderr
    assert re.fullmatch(
        r"polytrain: worker rank 2 died \(SIGKILL\) [\d.]+ s into the run; training "
        r"continues with the others",
        warnings[0],
    ), stderr
    assert "final loss" in stdout


def test_async_run_fails_when_server_is_killed(tmp_path: Path) -> None:
    launcher, _, stderr, _ = run_and_kill(tmp_path, rank=3)
    assert launcher.returncode == 1, stderr
    assert "polytrain: error: worker rank 3 failed: exit: killed by SIGKILL" in stderr, stderr
    assert "training continues" not in stderr
