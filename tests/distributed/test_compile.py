"""``train.compile``: compiled blocks under dp2, ZeRO-3 (with recomputation), tp2 and a 1F1B
pipeline reproduce the eager single-process run parameter by parameter (contract 1), and the
first step's compilation is reported apart from step time (Inductor on the CPU: slow, so one
tiny model, three steps, one case per family).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from polytrain.testing import assert_state_close, run_job
from tests.conftest import small_job

pytestmark = pytest.mark.slow

STEPS = 3
# One hidden layer: blocks of distinct classes, so each compiles once (a second hidden layer of
# another width would compile again, with dynamic shapes: more time, no more coverage).
MODEL = {"name": "mlp", "n_layer": 1}


def _job(**sections: dict[str, Any]) -> Any:
    train = {"steps": STEPS, **sections.pop("train", {})}
    return small_job(model=MODEL, train=train, **sections)


@cache
def reference() -> dict[str, Any]:
    """The eager single-process run."""
    return run_job(_job())


@pytest.mark.parametrize(
    "sections",
    [
        {"parallel": {"dp": 2, "zero": 3, "recompute": True}},
        {"parallel": {"tp": 2}},
        {"parallel": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}},
    ],
    ids=["zero3-recompute", "tp2", "1f1b-pp2"],
)
def test_compiled_matches_eager_single_process(sections: dict[str, Any]) -> None:
    out = run_job(_job(train={"compile": True}, launch={"nproc": 2}, **sections))
    ref = reference()
    assert_state_close(out["state"], ref["state"], atol=1e-5)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    # Compilation happened, in the first step: seconds, against milliseconds for a step.
    assert out["history"][0]["compile_s"] > 0.5


def test_dp2_compiled_reports_compile_time_apart(tmp_path: Path) -> None:
    out = run_job(
        _job(
            train={"compile": True},
            parallel={"dp": 2},
            launch={"nproc": 2},
            observe={"out_dir": str(tmp_path)},
        )
    )
    ref = reference()
    assert_state_close(out["state"], ref["state"], atol=1e-5)
    assert out["strategy"] == "ddp-dp2"
    summary = json.loads((tmp_path / "rank-0.json").read_text())
    first_step, *later = summary["step_times_s"]
    median = sorted(later)[len(later) // 2]  # the compiling first step left out
    assert summary["median_step_time_s"] == median
    assert summary["compile_s"] == pytest.approx(first_step - median)
    assert summary["compile_s"] > 0.5
    assert summary["median_step_time_s"] < summary["compile_s"]
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["compile_s"] == pytest.approx(summary["compile_s"])
