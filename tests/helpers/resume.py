"""An uninterrupted run with checkpoints, and the same run resumed from its middle checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from polytrain.testing import run_job
from polytrain.trainer.manifest import step_dir
from tests.conftest import small_job

STEPS, EVERY = 6, 3


def resumed_after_step_3(
    tmp_path: Path, **sections: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``small_job(**sections)`` trained 6 steps with a checkpoint every 3, then resumed from a
    copy of its checkpoints without the last one: (uninterrupted result, resumed result)."""

    def job(ckpt: Path, resume: bool) -> Any:
        checkpoint = {"dir": str(ckpt), "every": EVERY, "keep": 5, "resume": resume}
        return small_job(train={"steps": STEPS}, checkpoint=checkpoint, **sections)

    full = run_job(job(tmp_path / "a", False))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(step_dir(tmp_path / "b", STEPS))
    return full, run_job(job(tmp_path / "b", True))
