"""Issue 11, case 2: every optimizer, stateless ones included, resumes from a checkpoint.

SGD without momentum keeps no tensor state; its resume failed with ``AssertionError: Expected
device to be set`` inside torch's ``set_state_dict``. Each optimizer here runs 4 steps
uninterrupted, and 2 + 2 steps through a checkpoint; the final weights must be equal bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from polytrain.config import JobConfig
from polytrain.testing import run_job
from tests.conftest import small_job

pytestmark = pytest.mark.slow

# AdamW and SGD with momentum are covered by test_checkpoint.py / test_restart.py.
OPTIMIZERS = {"sgd momentum 0": {"name": "sgd", "momentum": 0.0}}


def job(optim: dict[str, Any], steps: int, ckpt: Path | None, resume: bool = False) -> JobConfig:
    checkpoint = {"dir": str(ckpt), "every": 2, "resume": resume} if ckpt else {}
    return small_job(
        optim=optim, train={"steps": steps}, checkpoint=checkpoint, launch={"nproc": 2}
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_round_trips_through_a_checkpoint(name: str, tmp_path: Path) -> None:
    # Issue 11, case 2.
    optim = OPTIMIZERS[name]
    full = run_job(job(optim, 4, None), timeout_s=120)
    run_job(job(optim, 2, tmp_path), timeout_s=120)
    resumed = run_job(job(optim, 4, tmp_path, resume=True), timeout_s=120)
    assert resumed["start"] == 2
    for key, value in full["state"].items():
        assert torch.equal(value, resumed["state"][key]), key
