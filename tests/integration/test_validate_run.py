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


@pytest.mark.slow
def test_pipedream_ranks_report_the_gradients_held_at_the_update(tmp_path: Path) -> None:
    """PipeDream frees its gradients after each update, so the after-run reading has none; the
    reading just before the last update ([Note: model states at the update]) has them all."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    base = {"model.name": "mlp", "data.source": str(corpus), "train.global_batch_size": 8}
    layout = Layout(pp=2, schedule="pipedream", microbatches=2)
    (trial,) = run_trials([TrialSpec(layout, 0.01)], base, tmp_path / "runs", steps=3)
    assert trial.ok, trial.error
    for rank in trial.ranks:
        after, at = rank["state_bytes"], rank["state_bytes_at_update"]
        assert after["grads"] == 0
        assert at["grads"] == at["params"] == after["params"]
        assert at["optimizer"] == 2 * at["params"]
    assert trial.state_bytes == max(4 * r["state_bytes"]["params"] for r in trial.ranks)
