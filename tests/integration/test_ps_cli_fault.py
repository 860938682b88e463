"""Through the ``polytrain`` command: a PS async worker killed mid-run does not stop training.

Starts ``polytrain train --sync ps --ps-mode async`` with 4 ranks (rank 3 the server, 0-2
workers), waits until rank 0 has logged step 5, SIGKILLs worker rank 2 (found as a child of the
launcher in /proc, by its ``RANK`` environment variable), and checks that the launcher warns once,
keeps the others running, and exits 0 after the last step. See [Note: tolerated worker deaths]
in launch/tolerant.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from polytrain.config import job_from_dict
from polytrain.ps.family import PARAMETER_SERVER
from polytrain.trainer.build import strategy_family
from tests.helpers.cli_runs import SignalledRun, last_step, train_and_signal

pytestmark = pytest.mark.slow

# The surviving run trains every step after the kill at step 5: hundreds of steps (seconds) left
# after the kill, against the launcher's 0.1 s poll that notices the death.
STEPS = 400


def test_tolerated_ranks_are_ps_async_workers_but_rank_0() -> None:
    def job(**ps: object) -> list[int]:
        return PARAMETER_SERVER.tolerated_ranks(
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
    assert strategy_family(job_from_dict({})).tolerated_ranks(job_from_dict({})) == []


def run_and_kill(tmp_path: Path, rank: int) -> SignalledRun:
    """The async run with ``rank`` SIGKILLed once rank 0 has logged step 5."""
    out = tmp_path / "run"
    return train_and_signal(
        [
            *("--model", "mlp", "--sync", "ps", "--ps-mode", "async", "--ps-servers", "1"),
            *("--nproc", "4", "--steps", str(STEPS), "--batch-size", "12", "--no-progress"),
            *("--out-dir", str(out), "--set", "observe.log_every=1"),
        ],
        tmp_path,
        out / "metrics.jsonl",
        rank=rank,
    )


def test_async_run_survives_killed_worker(tmp_path: Path) -> None:
    run = run_and_kill(tmp_path, rank=2)
    stdout, stderr = run.stdout, run.stderr
    assert run.signalled_at_step < STEPS - 100  # killed well before the end
    assert run.returncode == 0, stderr
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
    run = run_and_kill(tmp_path, rank=3)
    stderr = run.stderr
    assert run.returncode == 1, stderr
    assert "polytrain: error: worker rank 3 failed: exit: killed by SIGKILL" in stderr, stderr
    assert "training continues" not in stderr


def test_leaf_roles_are_named_for_the_launcher() -> None:
    """[Note: leaf servers]: each leaf runs on its group's lowest rank."""
    job = job_from_dict(
        {
            "parallel": {"sync": "ps"},
            "ps": {"servers": 1, "leaves": 2},
            "launch": {"nproc": 5},
            "train": {"global_batch_size": 8},
        }
    )
    assert PARAMETER_SERVER.rank_roles(job) == {
        0: "leaf server leaf0 of worker ranks 0-1",
        2: "leaf server leaf1 of worker ranks 2-3",
    }
    assert PARAMETER_SERVER.tolerated_ranks(job) == []


def test_killed_leaf_ends_the_sync_job_in_one_line_naming_it(tmp_path: Path) -> None:
    """Sync leaves (groups [0, 1] and [2, 3], root rank 4): SIGKILL rank 2, leaf1's rank."""
    out = tmp_path / "run"
    run = train_and_signal(
        [
            *("--model", "mlp", "--sync", "ps", "--ps-servers", "1", "--ps-leaves", "2"),
            *("--nproc", "5", "--steps", str(STEPS), "--batch-size", "8", "--no-progress"),
            *("--out-dir", str(out), "--set", "observe.log_every=1"),
        ],
        tmp_path,
        out / "metrics.jsonl",
        rank=2,
    )
    assert run.returncode == 1, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("polytrain: error:")]
    assert len(errors) == 1, run.stderr
    assert errors[0].startswith(
        "polytrain: error: worker rank 2 (leaf server leaf1 of worker ranks 2-3) failed: exit: "
        "killed by SIGKILL"
    ), run.stderr
