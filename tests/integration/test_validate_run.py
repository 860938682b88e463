"""`planner.validate.run_trials` runs a real job and reads what each rank held."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytrain.planner.types import Layout
from polytrain.planner.validate import TrialSpec, run_trials


@pytest.mark.slow
def test_one_trial_reports_step_time_and_model_state_bytes(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    base = {"model.name": "mlp", "data.source": str(corpus), "train.global_batch_size": 8}
    (trial,) = run_trials([TrialSpec(Layout(dp=1), 0.01)], base, tmp_path / "runs", steps=4)
    assert trial.ok, trial.error
    assert trial.measured_step_s > 0
    (rank,) = trial.ranks
    held = rank["state_bytes"]
    # AdamW in fp32 on one process: weights, gradients and two moments, 4 bytes each.
    assert held["grads"] == held["params"] and held["optimizer"] == 2 * held["params"]
    assert trial.state_bytes == 4 * held["params"]
    assert trial.peak_bytes > trial.state_bytes
