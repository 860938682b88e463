"""``plan --validate``: the runs keep the user's work fields and the priced partition."""

from __future__ import annotations

import pytest

from polytrain.cli.plan_validate import job_fields, trial_specs, validate_plans
from polytrain.config.io import job_from_dict
from polytrain.errors import PlanError
from polytrain.planner.types import BlockStats, Layout, ModelStats, Prediction


def test_job_fields_keep_the_work_and_drop_the_layout() -> None:
    job = job_from_dict({"model": {"name": "mlp"}, "train": {"steps": 7}, "launch": {"nproc": 4}})
    fields = job_fields(job)
    assert fields["model.name"] == "mlp" and fields["train.steps"] == 7
    assert not any(k.startswith(("parallel.", "launch.", "pipeline.", "ps.")) for k in fields)
    assert "model.n_layer" not in fields  # unset (None) fields stay unset


def test_pipeline_specs_carry_the_partition_the_model_priced() -> None:
    blocks = tuple(
        BlockStats(f"blocks.{i}", 10, 40, f, 0.0, 4.0) for i, f in enumerate([0, 9, 9, 1])
    )
    stats = ModelStats("m", blocks)
    preds = [Prediction(Layout(pp=2, microbatches=2), 0.1, 1.0), Prediction(Layout(dp=2), 0.2, 1.0)]
    pipe, flat = trial_specs(preds, stats)
    assert sum(pipe.extra["pipeline.partition"]) == 4 and flat.extra == {}
    assert pipe.predicted_step_s == 0.1


def test_validate_needs_at_least_one_plan() -> None:
    with pytest.raises(PlanError, match="--validate 0"):
        validate_plans(job_from_dict({}), [], 0)
