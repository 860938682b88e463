"""SPMD recomputation (`core/recompute.py`, torch.utils.checkpoint on each block's own
forward) under DDP and FSDP2 reproduces the single-process run without it (contract 1)."""

from __future__ import annotations

from typing import Any

import pytest

from polytrain.testing import assert_state_close, run_job
from tests.conftest import small_job

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "parallel",
    [{"dp": 2, "recompute": True}, {"dp": 2, "zero": 3, "recompute": True}],
    ids=["ddp-recompute", "zero3-recompute"],
)
def test_recompute_matches_single_process(parallel: dict[str, Any]) -> None:
    ref = run_job(small_job(model={"name": "gpt", "n_layer": 2}))
    out = run_job(
        small_job(model={"name": "gpt", "n_layer": 2}, parallel=parallel,
                  launch={"nproc": 2})
    )  # fmt: skip
    assert_state_close(out["state"], ref["state"], atol=1e-5)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)
