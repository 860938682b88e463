"""Issue 11, cases 1 and 6: a checkpoint directory belongs to one job ([Note: checkpoint
ownership] in trainer/ownership.py), and resuming past the last step says so in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytrain.cli.app import main
from polytrain.config.base import to_dict
from polytrain.testing import run_job
from polytrain.trainer.manifest import MANIFEST, Manifest, committed, step_dir
from polytrain.trainer.ownership import job_identity
from tests.conftest import small_job

pytestmark = pytest.mark.slow

# The same job as small_job(...) below, as flags.
FLAGS = ["--model", "mlp", "--optimizer", "sgd", "--batch-size", "16", "--seed", "1"]


def job(ckpt: Path, steps: int = 4) -> object:
    return small_job(train={"steps": steps}, checkpoint={"dir": str(ckpt), "every": 2, "keep": 2})


def foreign_checkpoint(root: Path, step: int) -> Path:
    """A valid (manifest-only) checkpoint written by another job (seed 99)."""
    other = small_job(train={"seed": 99})
    path = step_dir(root, step)
    path.mkdir(parents=True)
    manifest = Manifest(
        step=step,
        layout={},
        data={},
        lr_schedule={},
        optimizer={},
        rng={},
        versions={},
        job_fingerprint="0",
        job=to_dict(other),
        job_identity=job_identity(other),
    )
    (path / MANIFEST).write_text(manifest.to_json())
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding this job's checkpoints of steps 2 and 4."""
    root = tmp_path_factory.mktemp("owned") / "ckpt"
    run_job(job(root), timeout_s=120)  # type: ignore[arg-type]
    return root


def dry_run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--dry-run", "--nproc", "1", *FLAGS, *args])
    return int(exc.value.code or 0), capsys.readouterr().err


def test_pruning_touches_only_this_jobs_valid_checkpoints(tmp_path: Path) -> None:
    # Issue 11, case 1: before, keep = 2 kept the bogus step_999999999999 and the other job's
    # step 100 and deleted both of this job's checkpoints right after writing them.
    root = tmp_path / "ckpt"
    (root / "step_999999999999").mkdir(parents=True)
    foreign = foreign_checkpoint(root, 100)
    run_job(job(root), timeout_s=120)  # type: ignore[arg-type]
    assert [s for s, _ in committed(root)] == [999999999999, 100, 4, 2]
    assert (foreign / MANIFEST).is_file()


def test_a_directory_of_another_job_is_refused_before_the_run(
    written: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 11, case 1: before, both runs started (exit 0) and the second loaded the first's
    # weights or pruned them away.
    code, err = dry_run(["--checkpoint-dir", str(written), "--seed", "2", "--resume"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "another job (step 4: train.seed = 1 there, 2 here)" in err
    assert "checkpoint.adopt" in err
    code, err = dry_run(["--checkpoint-dir", str(written)], capsys)  # fresh run, same job
    assert code == 2 and "pass --resume" in err, err
    adopt = ["--set", "checkpoint.adopt=true"]
    args = ["--checkpoint-dir", str(written), "--seed", "2", "--resume", "--steps", "8"]
    code, err = dry_run([*args, *adopt], capsys)
    assert code == 0, err
    assert [s for s, _ in committed(written)] == [4, 2]  # pre-flight touched nothing


def test_resume_at_or_past_the_last_step_is_one_line(
    written: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 11, case 6: before, "final loss nan", a metrics path that did not exist, exit 0.
    code, err = dry_run(["--checkpoint-dir", str(written), "--resume", "--steps", "4"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "newest valid checkpoint is at step 4" in err and "raise --steps above 4" in err
    code, err = dry_run(["--checkpoint-dir", str(written), "--resume", "--steps", "6"], capsys)
    assert code == 0, err
