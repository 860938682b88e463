"""The planner's probe of DTensor's end of step on a mesh of two ranks.

[Note: DTensor end of step] in measure/probes.py: `calibrate` runs the check and the optimizers
on two ranks at once, whose timing loops make different numbers of calls (nothing in those
parts may communicate), and the clip, whose norm does communicate, on one.
"""

from __future__ import annotations

import pytest

from polytrain.measure.probes import OPTIMIZERS, mean_costs, rank_dtensor_step_costs
from polytrain.testing import run_distributed

pytestmark = pytest.mark.slow

SHAPES = ((16, 64), (2, 4096))


def test_the_local_parts_run_on_two_ranks_and_average() -> None:
    parts = ("check", *OPTIMIZERS)
    per_rank = run_distributed(rank_dtensor_step_costs, 2, SHAPES, 0.05, parts, timeout_s=120.0)
    costs = mean_costs(per_rank)
    assert set(costs) == {f"dtensor {part}" for part in parts}
    assert all(a >= 0 and b >= 0 for a, b in costs.values())
    assert costs["dtensor adamw"][0] > 0  # DTensor's dispatch per tensor
    first, second = (r["dtensor adamw"][0] for r in per_rank)
    assert costs["dtensor adamw"][0] == (first + second) / 2


def test_the_clip_runs_on_one_rank_alone() -> None:
    (costs,) = run_distributed(rank_dtensor_step_costs, 1, SHAPES, 0.05, ("clip",))
    assert set(costs) == {"dtensor clip"}
    assert costs["dtensor clip"][0] > 0 or costs["dtensor clip"][1] > 0
