"""fp16 with dynamic loss scaling ([Note: dynamic loss scaling] in polytrain.core.loss_scale).

Data parallel, ZeRO-3, a GPipe pipeline and ZeRO-3 inside 1F1B stages under fp16 reproduce the single-process fp16 run
(the same loss scale on every rank, the same skipped steps).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from polytrain.config import JobConfig
from polytrain.testing import assert_state_close, run_job
from tests.conftest import small_job

pytestmark = pytest.mark.slow

GPT = {"name": "gpt", "n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16}


def _job(**sections: dict[str, Any]) -> JobConfig:
    train = {"dtype": "fp16", "steps": 6, "on_nonfinite": "stop", **sections.pop("train", {})}
    # SGD: AdamW would blow the fp16 rounding of gradients that are zero in exact arithmetic
    # (attention's key bias) up to full-size updates, and parity could not be asked of it.
    return small_job(model=GPT, train=train, optim={"grad_clip": 1.0}, **sections)


@cache
def reference() -> dict[str, Any]:
    return run_job(_job())


def test_fp16_trains_in_half_precision() -> None:
    """The run is really fp16 (not the fp32 run) and still close to it; overflows and the
    scale's back-off are checked in tests/unit/test_core.py."""
    ref = reference()
    fp32 = run_job(_job(train={"dtype": "fp32"}))
    assert ref["losses"][-1] < ref["losses"][0]
    assert ref["losses"] != fp32["losses"]
    assert ref["losses"] == pytest.approx(fp32["losses"], abs=5e-2)


@pytest.mark.parametrize(
    ("world", "sections"),
    [
        (2, {"parallel": {"dp": 2}}),
        (2, {"parallel": {"dp": 2, "zero": 3}}),
        (2, {"parallel": {"pp": 2, "dp": 1}, "pipeline": {"schedule": "gpipe"}}),
        (4, {"parallel": {"pp": 2, "dp": 2, "zero": 3}, "pipeline": {"schedule": "1f1b"}}),
    ],
    ids=["dp2", "zero3-dp2", "gpipe-pp2", "zero3-dp2-1f1b-pp2"],
)
def test_fp16_matches_single_process(world: int, sections: dict[str, Any]) -> None:
    ref = reference()
    out = run_job(_job(launch={"nproc": world}, **sections))
    assert [r.get("skipped", False) for r in out["history"]] == [
        r.get("skipped", False) for r in ref["history"]
    ]
    assert_state_close(out["state"], ref["state"], atol=1e-4)
