"""Issue 11, case 3, through the ``polytrain`` command: a hung worker of an async
parameter-server job does not hang the launcher ([Note: tolerated worker deaths] in
launch/tolerant.py).

Worker rank 2 is SIGSTOPped after step 5; the server drops it once it has been silent for
``ps.worker_timeout_s``; rank 0 finishes. Before, the launcher kept waiting for the stopped
process forever; now it ends it with one line naming it and exits 0.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.helpers.cli_runs import last_step, train_and_signal

pytestmark = pytest.mark.slow

STEPS = 300


def test_a_stopped_async_worker_is_ended_and_the_run_exits(tmp_path: Path) -> None:
    # Issue 11, case 3.
    out = tmp_path / "run"
    run = train_and_signal(
        [
            *("--model", "mlp", "--sync", "ps", "--ps-mode", "async", "--ps-servers", "1"),
            *("--nproc", "4", "--steps", str(STEPS), "--batch-size", "12", "--no-progress"),
            *("--out-dir", str(out), "--set", "observe.log_every=1"),
            *("--set", "ps.worker_timeout_s=3", "--save-final", str(tmp_path / "w.safetensors")),
        ],
        tmp_path,
        out / "metrics.jsonl",
        rank=2,
        sig=signal.SIGSTOP,
        start_timeout_s=120,
        end_timeout_s=300,  # before the fix the launcher never returned
    )
    print(f"figure: launcher exited {run.exit_after_s:.1f} s after the SIGSTOP")
    stderr = run.stderr
    assert "final loss" in run.stdout
    assert run.returncode == 0, stderr
    assert last_step(out / "metrics.jsonl") == STEPS
    assert (tmp_path / "w.safetensors").is_file()
    notes = [line for line in stderr.splitlines() if "worker rank 2" in line]
    assert len(notes) == 1 and "ended it with SIGKILL" in notes[0], stderr
