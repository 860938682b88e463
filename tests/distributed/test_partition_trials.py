"""[Note: partition trials]: `auto` times the profile's best partition and its neighbours inside
the pipeline and keeps the fastest, which corrects a profile that misjudges a block."""

from __future__ import annotations

from typing import Any

import pytest

from polytrain.testing import run_distributed
from tests.conftest import small_job

pytestmark = pytest.mark.slow


def _ranges(rank: int, world_size: int, trials: list[int]) -> list[Any]:
    from polytrain.comm.init import init_distributed
    from polytrain.pipeline.strategy import PipelineStrategy
    from tests.helpers.strategies import job_strategy

    ctx = init_distributed()
    out = []
    for k in trials:
        job = small_job(
            model={"name": "tests.helpers.models:misprofiled"},
            parallel={"pp": 2},
            pipeline={"partition": "auto", "microbatches": 4, "partition_trials": k},
            launch={"nproc": 2},
        )
        strategy = job_strategy(job, ctx)
        assert isinstance(strategy, PipelineStrategy)
        out.append(strategy.ranges)
    return out


def test_trials_pick_the_partition_that_is_fastest_in_the_pipeline() -> None:
    profile_only, with_trials = run_distributed(_ranges, 2, [0, 3], timeout_s=120)[0]
    assert profile_only == [(0, 2), (2, 6)]  # the profile isolates the "slow" block 1
    assert with_trials == [(0, 3), (3, 6)]  # really balanced: 30 ms per stage, not 20 and 40
