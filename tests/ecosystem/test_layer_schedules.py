"""Interleaved 1F1B, ZB-H1 and ZBV over a transformers model's own layers match one process.

A user's model is pipelined over its repeated layers (`pipeline.layer_stage`); under
interleaved 1F1B and ZBV a rank holds two slices of them ([Note: several layer stages per
rank]), under ZB-H1 each backward is split into I and W (`pipeline.backward_split`). GPT-2
with 4 layers on pp 2 (4 stages for interleaved and ZBV): its tied ``wte`` / ``lm_head``
spans ranks 0 and 1 under interleaved and ZB-H1, and sits on rank 0 twice under ZBV (the V
puts the first and the last stage there). Tolerance as `test_transformers`: every parameter
within 2e-5 of the single-process run after 3 AdamW steps.
"""

from __future__ import annotations

from typing import Any

import pytest

from polytrain.config import JobConfig
from polytrain.testing import run_job
from polytrain.testing.harness import run_distributed
from polytrain.trainer.loop import train
from tests.ecosystem.test_transformers import assert_matches, data_file
from tests.helpers.hf_models import hf_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL: dict[str, Any] = {"args": {"n_layer": 4}}
# name -> (pipeline section, strategy name)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "interleaved-pp2-v2": (
        {"schedule": "interleaved-1f1b", "virtual_stages": 2, "microbatches": 2},
        "interleaved-1f1b-pp2-v2-m2",
    ),
    "zb-h1-pp2": ({"schedule": "zb-h1", "microbatches": 2}, "zb-h1-pp2-m2"),
    "zbv-pp2": ({"schedule": "zbv", "microbatches": 2}, "zbv-pp2-m2"),
}


def _train_each(rank: int, world_size: int, jobs: list[JobConfig]) -> list[dict[str, Any]] | None:
    """Train every job in turn in the same two processes: each imports transformers once."""
    results = [train(job) for job in jobs]
    if rank != 0:
        return None
    return [
        {
            "state": r.state_dict,
            "losses": [h["loss"] for h in r.history],
            "val_loss": r.val_loss,
            "strategy": r.strategy,
        }
        for r in results
    ]


def test_matches_single_process() -> None:
    jobs = [
        hf_job("gpt2", data_file("gpt2"), 2, model=MODEL, parallel={"pp": 2}, pipeline=pipeline)
        for pipeline, _ in CASES.values()
    ]
    outs = run_distributed(_train_each, 2, jobs, timeout_s=300)[0]
    assert outs is not None
    ref = run_job(hf_job("gpt2", data_file("gpt2"), model=MODEL), timeout_s=300)
    for (case, (_, strategy)), out in zip(CASES.items(), outs, strict=True):
        assert out["strategy"] == strategy, case
        try:
            assert_matches(out, ref)  # names the parameter that differs
        except AssertionError as e:
            raise AssertionError(f"{case}: {e}") from None
        assert out["val_loss"] == pytest.approx(ref["val_loss"], abs=2e-5), case
