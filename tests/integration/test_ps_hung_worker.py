"""Issue 11, case 3, through the ``polytrain`` command: a hung worker of an async
parameter-server job does not hang the launcher ([Note: tolerated worker deaths] in
launch/tolerant.py).

Worker rank 2 is SIGSTOPped after step 5; the server drops it once it has been silent for
``ps.worker_timeout_s``; rank 0 finishes. Before, the launcher kept waiting for the stopped
process forever; now it ends it with one line naming it and exits 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_ps_cli_fault import ENV, last_step, worker_of_rank

pytestmark = pytest.mark.slow

STEPS = 300


def test_a_stopped_async_worker_is_ended_and_the_run_exits(tmp_path: Path) -> None:
    # Issue 11, case 3.
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [
            *(sys.executable, "-m", "polytrain.cli.app", "train", "--model", "mlp"),
            *("--sync", "ps", "--ps-mode", "async", "--ps-servers", "1", "--nproc", "4"),
            *("--steps", str(STEPS), "--batch-size", "12", "--no-progress"),
            *("--out-dir", str(out), "--set", "observe.log_every=1"),
            *("--set", "ps.worker_timeout_s=3", "--save-final", str(tmp_path / "w.safetensors")),
        ],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    victim = None
    try:
        deadline = time.monotonic() + 300
        while last_step(out / "metrics.jsonl") < 5:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "rank 0 never reached step 5"
            time.sleep(0.05)
        victim = worker_of_rank(launcher.pid, 2)
        assert victim is not None
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        stdout, stderr = launcher.communicate(timeout=300)  # before: never returned
        print(f"figure: launcher exited {time.monotonic() - stopped:.1f} s after the SIGSTOP")
        assert "final loss" in stdout
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)  # never leave a stopped process behind
    assert launcher.returncode == 0, stderr
    assert last_step(out / "metrics.jsonl") == STEPS
    assert (tmp_path / "w.safetensors").is_file()
    notes = [line for line in stderr.splitlines() if "worker rank 2" in line]
    assert len(notes) == 1 and "ended it with SIGKILL" in notes[0], stderr
