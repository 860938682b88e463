"""Parameter servers and ``train.on_nonfinite`` on gloo ranks (issue 10): stop and skip.

Worker rank 1's gradients turn NaN at step 3 (tests/helpers/faults.py) while its loss stays
finite; rank 2 is the server. [Note: parameter-server NaN] in polytrain.ps.strategy.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from polytrain.config import JobConfig
from polytrain.core.strategy import NonFiniteLossError
from polytrain.testing import run_distributed
from polytrain.trainer.loop import train
from tests.conftest import small_job
from tests.helpers.faults import BLOCK_SIZE

pytestmark = pytest.mark.slow

WORLD = 3  # workers 0 and 1, server 2


def _run(rank: int, world_size: int, job: JobConfig) -> dict[str, Any]:
    """Every rank's outcome: its NonFiniteLossError message, or its history and weights."""
    try:
        result = train(job)
    except NonFiniteLossError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # e.g. a worker that lost the stopped server
        return {"other": f"{type(exc).__name__}: {exc}"}
    return {"history": result.history, "state": result.state_dict}


def _job(mode: str, on_nonfinite: str) -> JobConfig:
    return small_job(
        model={"name": "tests.helpers.faults:nan_grad_rank1_step3", "block_size": BLOCK_SIZE},
        train={"steps": 5, "on_nonfinite": on_nonfinite},
        parallel={"sync": "ps"},
        ps={"servers": 1, "mode": mode},
        launch={"nproc": WORLD},
    )


def test_sync_stop_stops_every_worker_and_the_server_naming_the_step() -> None:
    out = run_distributed(_run, WORLD, _job("sync", "stop"), timeout_s=120)
    for rank in range(WORLD):
        assert "error" in out[rank], f"rank {rank} did not stop: {out[rank]}"
        assert "at step 3" in out[rank]["error"] or "of step 3" in out[rank]["error"]
    assert out[0]["error"].startswith("a gradient is NaN/Inf (loss")
    assert out[2]["error"].startswith("server 0: the update of step 3 is NaN/Inf")


def test_async_stop_stops_the_bad_worker_and_the_server() -> None:
    """async: no collective between workers, so the healthy one learns of the stop only by
    losing the server; the worker that saw the NaN and the server name the step."""
    out = run_distributed(_run, WORLD, _job("async", "stop"), timeout_s=120)
    assert out[1].get("error", "").startswith("a gradient is NaN/Inf (loss")
    assert "at step 3" in out[1]["error"]
    assert out[2].get("error", "").startswith("server 0: the update of step 3 is NaN/Inf")
    assert "rank 2" in out[0].get("other", ""), out[0]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_skip_drops_the_update_on_the_server_and_reports_it(mode: str) -> None:
    out = run_distributed(_run, WORLD, _job(mode, "skip"), timeout_s=120)
    worker = out[1]["history"]
    assert [r["step"] for r in worker if r.get("skipped")] == [3]
    assert len(worker) == 5
    server = out[2]["history"]
    assert server[-1]["ps_skipped_updates"] == 1.0
    if mode == "sync":  # one update per step: the server's step 3 is the dropped one
        assert [r["step"] for r in server if r.get("skipped")] == [3]
        assert [r["step"] for r in out[0]["history"] if r.get("skipped")] == [3]
    state = out[0]["state"]
    assert state and all(math.isfinite(float(v.abs().sum())) for v in state.values())

