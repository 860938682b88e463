"""``plan --validate``: the runs keep the user's work fields and the priced partition."""

from __future__ import annotations

import pytest

from polytrain.cli.plan_validate import job_fields, trial_specs, validate_plans
from polytrain.config.io import job_from_dict
from polytrain.errors import PlanError
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.partition import balanced_stages
from polytrain.planner.types import BlockStats, Layout, ModelStats


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
    env = Env(parse_cluster("1x2xcpu"))
    preds = [
        predict(Layout(pp=2, microbatches=2), stats, env, 4),
        predict(Layout(dp=2), stats, env, 4),
    ]
    pipe, flat = trial_specs(preds)
    priced = [len(s) for s in balanced_stages(blocks, 2)]
    assert pipe.layout.overrides()["pipeline.partition"] == priced and sum(priced) == 4
    assert "pipeline.partition" not in flat.layout.overrides()
    assert pipe.predicted_step_s == preds[0].step_s
    # the peak compared with a worker's resident peak counts what the process holds besides
    (held,) = trial_specs(preds[1:], process=300e6)
    assert held.predicted_peak_bytes == preds[1].memory_per_rank + 300e6


def test_validate_needs_at_least_one_plan() -> None:
    with pytest.raises(PlanError, match="--validate 0"):
        validate_plans(job_from_dict({}), [], 0)
