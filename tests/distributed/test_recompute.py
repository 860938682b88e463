"""Recomputation (`core/recompute.py`: a checkpoint of each block's own forward; whole, every
K-th block, or selective per op) reproduces the single-process run without it (contract 1),
under DDP, FSDP2, a 1F1B pipeline and parameter servers."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from polytrain.testing import assert_state_close, run_job
from tests.conftest import small_job

pytestmark = pytest.mark.slow

MODEL = {"name": "gpt", "n_layer": 2}


@cache
def reference() -> dict[str, Any]:
    return run_job(small_job(model=MODEL))


@pytest.mark.parametrize(
    "sections",
    [
        {"parallel": {"dp": 2, "recompute": True}},
        {"parallel": {"dp": 2, "zero": 3, "recompute": True}},
        {"parallel": {"dp": 2, "recompute": "ops"}},
        {"parallel": {"dp": 2, "zero": 3, "recompute": "every:2"}},
        {
            "parallel": {"pp": 2, "recompute": "ops"},
            "pipeline": {"schedule": "1f1b", "microbatches": 2},
        },
        {"parallel": {"sync": "ps", "recompute": "ops"}, "ps": {"servers": 1}},
    ],
    ids=[
        "ddp-full",
        "zero3-full",
        "ddp-ops",
        "zero3-every2",
        "1f1b-ops",
        "ps-ops",
    ],
)
def test_recompute_matches_single_process(sections: dict[str, Any]) -> None:
    nproc = 3 if sections["parallel"].get("sync") == "ps" else 2
    out = run_job(small_job(model=MODEL, launch={"nproc": nproc}, **sections))
    ref = reference()
    assert_state_close(out["state"], ref["state"], atol=1e-5)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)
