"""Through the ``polytrain`` command: a killed worker is restarted and resumes; loopback only.

The kill test starts a real run, waits for its step-10 checkpoint, kills one worker process by
pid (found as a child of the launcher in /proc), and checks that the elastic agent restarted the
workers, that they resumed from the checkpoint, and that the final weights equal those of an
uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from polytrain.config import job_from_dict, load_job
from polytrain.testing import run_job, scaled
from tests.helpers.cli_runs import start_train, wait_for, workers_of

pytestmark = pytest.mark.slow


def listening(pids: list[int]) -> list[str]:
    """Local addresses the given processes listen on (TCP), from ``ss -ltnp``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]


def test_killed_worker_restarts_and_resumes_to_the_same_weights(tmp_path: Path) -> None:
    run_dir, ckpt, final = tmp_path / "run", tmp_path / "ckpt", tmp_path / "final.safetensors"
    proc = start_train(
        *("--model", "tests.helpers.faults:slow", "--set", "model.block_size=16"),
        *("--steps", "60", "--nproc", "2", "--no-progress", "--max-restarts", "1"),
        *("--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"),
        *("--out-dir", str(run_dir), "--save-final", str(final)),
        cwd=tmp_path,
    )
    try:
        wait_for(lambda: len(workers_of(proc.pid)) == 2, 60, "two workers")
        workers = workers_of(proc.pid)
        wait_for(lambda: (ckpt / "step_000000010" / "manifest.json").exists(), 60, "step 10")
        # Security: every socket of the launcher and its workers listens on loopback only.
        if shutil.which("ss"):
            addresses = listening([proc.pid, *workers])
            assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), addresses
        os.kill(workers[1], signal.SIGKILL)  # mid-run: 50 steps of >= 50 ms remain
        out, err = proc.communicate(timeout=scaled(120))
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "polytrain: resumed from" in out, out
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert logged == sorted(set(logged)), f"steps repeated: the run restarted from 0 ({logged})"
    restarted = [p.name for p in (run_dir / "logs").rglob("attempt_*")]
    assert "attempt_1" in restarted, restarted
    # The uninterrupted run of the same job (read back from the run directory), without the
    # model's sleep, which only paced the run for the kill.
    data = load_job(run_dir / "job.toml")
    assert data["model"]["name"] == "tests.helpers.faults:slow"
    data["model"]["name"] = "tests.helpers.faults:steady"
    data["checkpoint"] = {}
    data["observe"] = {"progress": False}
    reference = run_job(job_from_dict(data))
    weights = load_file(str(final))
    assert set(weights) == set(reference["state"])
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference["state"][name]), f"{name} differs after the restart"


def test_nan_stop_is_one_line_naming_the_step(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = start_train(
        *("--model", "tests.helpers.faults:nan_loss_rank1_step3", "--set", "model.block_size=16"),
        *("--steps", "6", "--nproc", "2", "--no-progress"),
        *("--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"),
        cwd=tmp_path,
    )
    _, err = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 2, err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert "NonFiniteLossError: loss is nan at step 3" in lines[0]
    assert "step_000000002 (step 2), is intact" in lines[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000000002"]
