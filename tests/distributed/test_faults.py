"""NaN/Inf handling, hang diagnosis and the start-up job check, on 2 gloo ranks (issue 6).

Faults come from user model factories in tests/helpers/faults.py, on rank 1 only: the ranks
must still agree (stop or skip at the same step; the healthy rank names the missing one).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from polytrain.comm.watchdog import collective_timeout_s
from polytrain.config import JobConfig
from polytrain.testing import RankFailure, run_distributed
from polytrain.trainer.manifest import committed, verify
from tests.conftest import small_job
from tests.helpers.faults import BLOCK_SIZE

pytestmark = pytest.mark.slow


def _train(rank: int, world_size: int, jobs: list[JobConfig]) -> dict[str, Any] | None:
    from polytrain.trainer.loop import train

    result = train(jobs[rank])
    return {"history": result.history, "state": result.state_dict} if rank == 0 else None


def faulty(factory: str, **sections: dict[str, Any]) -> JobConfig:
    sections["model"] = {"name": f"tests.helpers.faults:{factory}", "block_size": BLOCK_SIZE}
    sections["train"] = {"steps": 6, **sections.get("train", {})}
    sections["launch"] = {"nproc": 2, **sections.get("launch", {})}
    return small_job(**sections)


def test_nan_loss_on_one_rank_stops_all_with_last_checkpoint_intact(tmp_path: Path) -> None:
    job = faulty("nan_loss_rank1_step3", checkpoint={"dir": str(tmp_path), "every": 2})
    with pytest.raises(RankFailure) as info:
        run_distributed(_train, 2, [job, job], timeout_s=90)
    message = str(info.value)
    assert "NonFiniteLossError: loss is nan at step 3" in message
    assert "step_000000002 (step 2), is intact" in message
    assert [step for step, _ in committed(tmp_path)] == [2]
    assert verify(tmp_path / "step_000000002").step == 2


def test_nan_gradient_with_finite_loss_is_caught_under_zero3() -> None:
    job = faulty("nan_grad_rank1_step3", parallel={"zero": 3})
    with pytest.raises(RankFailure, match=r"a gradient is NaN/Inf \(loss [0-9.]+\) at step 3"):
        run_distributed(_train, 2, [job, job], timeout_s=90)


def test_skip_drops_the_update_and_continues() -> None:
    job = faulty("nan_grad_rank1_step3", train={"steps": 6, "on_nonfinite": "skip"})
    out = run_distributed(_train, 2, [job, job], timeout_s=90)[0]
    skipped = [r["step"] for r in out["history"] if r.get("skipped")]
    assert skipped == [3]
    assert len(out["history"]) == 6
    assert all(math.isfinite(float(v.abs().sum())) for v in out["state"].values())


@pytest.mark.parametrize("on_nonfinite", ["stop", "skip"])
def test_fused_adamw_under_zero3_decides_on_the_device(on_nonfinite: str) -> None:
    """[Note: the step stays on the device]: FSDP2's DTensor parameters, fused AdamW's
    found_inf skip and the result read later name and skip the same step as the host path."""
    train = {"steps": 6, "on_nonfinite": on_nonfinite}
    job = faulty("nan_grad_rank1_step3", parallel={"zero": 3}, optim={"name": "adamw"}, train=train)
    if on_nonfinite == "stop":
        with pytest.raises(RankFailure, match=r"a gradient is NaN/Inf \(loss [0-9.]+\) at step 3"):
            run_distributed(_train, 2, [job, job], timeout_s=90)
        return
    out = run_distributed(_train, 2, [job, job], timeout_s=90)[0]
    assert [r["step"] for r in out["history"] if r.get("skipped")] == [3]
    assert all(math.isfinite(float(v.abs().sum())) for v in out["state"].values())


def test_a_rank_that_stops_participating_is_named() -> None:
    # Rank 1 hangs for an hour (hang_rank1_step3): a RankFailure from rank 0 naming it, before
    # the harness deadline's TimeoutError, shows the 3 s watchdog caught the hang; an order of
    # events, not a wall-clock bound, so it holds on a loaded machine.
    timeout = 3.0
    job = faulty("hang_rank1_step3", launch={"nproc": 2, "timeout_s": timeout})
    with pytest.raises(RankFailure) as info:
        # The harness makes the process group; give it the timeout the loop would.
        pg_timeout = collective_timeout_s(timeout)
        run_distributed(_train, 2, [job, job], timeout_s=90, collective_timeout_s=pg_timeout)
    message = str(info.value).splitlines()[0]
    assert message.startswith("rank 0 failed: CollectiveTimeoutError: train step 3 of ddp-dp2")
    assert "rank(s) [1] did not arrive: rank 1 (last started step 3)" in message


def test_ranks_given_different_jobs_are_named_at_start_up() -> None:
    job = faulty("slow")
    other = faulty("slow", train={"steps": 7})
    with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] were given a different job"):
        run_distributed(_train, 2, [job, other], timeout_s=90)


def test_async_parameter_server_jobs_refuse_checkpoints_clearly(tmp_path: Path) -> None:
    job = small_job(
        parallel={"sync": "ps"},
        ps={"mode": "async"},
        launch={"nproc": 2},
        checkpoint={"dir": str(tmp_path)},
    )
    with pytest.raises(RankFailure, match="only ps.mode = 'sync' parameter-server jobs can be"):
        run_distributed(_train, 2, [job, job], timeout_s=90)
