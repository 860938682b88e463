"""NaN gradients in a pipeline: every stage agrees to stop or skip (issue 6, pp 2 on gloo).

The model (tests/helpers/faults.py) poisons only a first-stage parameter's gradient at step 3;
the loss, computed on the last stage, stays finite, so only the gradient check can catch it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from polytrain.config import JobConfig
from polytrain.testing import RankFailure, run_distributed
from tests.conftest import small_job
from tests.helpers.faults import BLOCK_SIZE

pytestmark = pytest.mark.slow


def _train(rank: int, world_size: int, job: JobConfig) -> dict[str, Any]:
    from polytrain.trainer.loop import train

    result = train(job)
    return {"history": result.history, "state": result.state_dict}


def pipeline_job(on_nonfinite: str, schedule: str = "1f1b", **parallel: int) -> JobConfig:
    return small_job(
        model={"name": "tests.helpers.faults:nan_param_grad_first_block_step3_m2"}
        | {"block_size": BLOCK_SIZE},
        parallel={"pp": 2, **parallel},
        pipeline={"schedule": schedule, "microbatches": 2, "partition": [2, 2]},
        train={"steps": 5, "on_nonfinite": on_nonfinite},
        launch={"nproc": 2 * parallel.get("dp", 1)},
    )


@pytest.mark.parametrize(
    ("schedule", "parallel"),
    [("1f1b", {}), ("pipedream", {}), ("1f1b", {"dp": 2, "zero": 3})],
    ids=["1f1b", "pipedream", "1f1b-dp2-zero3"],
)
def test_pipeline_nan_gradient_with_finite_loss_stops_every_stage(
    schedule: str, parallel: dict[str, int]
) -> None:
    """PipeDream reads a step's result after the next step ran (deferred): it still names 3.
    Under ZeRO-3 the poisoned parameter's one value lies in one dp rank's shard only."""
    job = pipeline_job("stop", schedule, **parallel)
    with pytest.raises(RankFailure) as info:
        run_distributed(_train, job.world_size, job, timeout_s=90)
    # Rank 1 (the last stage) has finite gradients and loss: it stops because it agreed.
    message = str(info.value)
    assert "NonFiniteLossError: a gradient is NaN/Inf (loss" in message
    assert "at step 3" in message


def test_pipeline_skip_drops_the_update_on_every_stage() -> None:
    out = run_distributed(_train, 2, pipeline_job("skip"), timeout_s=90)
    for rank in (0, 1):
        history = out[rank]["history"]
        assert [r["step"] for r in history if r.get("skipped")] == [3]
        assert len(history) == 5
        assert all(math.isfinite(r["loss"]) for r in history)
    state = out[0]["state"]
    assert state is not None
    assert all(math.isfinite(float(v.abs().sum())) for v in state.values())
