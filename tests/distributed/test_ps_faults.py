"""Parameter-server faults on gloo ranks (issue 10): ``train.on_nonfinite`` stop and skip, and
a hung but live server named within ``launch.timeout_s``.

Worker rank 1's gradients turn NaN at step 3 (tests/helpers/faults.py) while its loss stays
finite; rank 2 is the server. [Note: parameter-server NaN] in polytrain.ps.strategy, [Note:
hung server] in polytrain.comm.ps_wire.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

import pytest

from polytrain.comm import ps_wire
from polytrain.config import JobConfig
from polytrain.core.strategy import NonFiniteLossError
from polytrain.ps.server import ParameterServer
from polytrain.testing import RankFailure, run_distributed
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


def _job(mode: str, on_nonfinite: str, world: int = WORLD, **ps: Any) -> JobConfig:
    return small_job(
        model={"name": "tests.helpers.faults:nan_grad_rank1_step3", "block_size": BLOCK_SIZE},
        train={"steps": 5, "on_nonfinite": on_nonfinite},
        parallel={"sync": "ps"},
        ps={"servers": 1, "mode": mode, **ps},
        launch={"nproc": world},
    )


def test_sync_stop_stops_every_worker_and_the_server_naming_the_step() -> None:
    out = run_distributed(_run, WORLD, _job("sync", "stop"), timeout_s=300)
    for rank in range(WORLD):
        assert "error" in out[rank], f"rank {rank} did not stop: {out[rank]}"
        assert "at step 3" in out[rank]["error"] or "of step 3" in out[rank]["error"]
    assert out[0]["error"].startswith("a gradient is NaN/Inf (loss")
    assert out[2]["error"].startswith("server 0: the update of step 3 is NaN/Inf")


def test_async_stop_stops_the_bad_worker_and_the_server() -> None:
    """async: no collective between workers, so the healthy one learns of the stop only by
    losing the server; the worker that saw the NaN and the server name the step."""
    out = run_distributed(_run, WORLD, _job("async", "stop"), timeout_s=300)
    assert out[1].get("error", "").startswith("a gradient is NaN/Inf (loss")
    assert "at step 3" in out[1]["error"]
    assert out[2].get("error", "").startswith("server 0: the update of step 3 is NaN/Inf")
    assert "rank 2" in out[0].get("other", ""), out[0]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_skip_drops_the_update_on_the_server_and_reports_it(mode: str) -> None:
    out = run_distributed(_run, WORLD, _job(mode, "skip"), timeout_s=300)
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


# -- a live server that stops serving ([Note: hung server] in polytrain.comm.ps_wire) --------

HANG_S = 600.0  # the harness kills the server once a worker has failed


def _run_with_hung_server(rank: int, world_size: int, job: JobConfig, marks: str) -> dict[str, Any]:
    """The server's main thread stops in the update of step 3 (clock 2); its process,
    receiver threads and connections stay alive. ``marks``/<rank> get the wall time at which
    the server stopped and at which each worker named it."""
    if rank == world_size - 1:
        apply = ParameterServer._step

        def hang(self: ParameterServer, clock: int, *rest: Any) -> None:
            if clock == 2:
                (Path(marks) / str(rank)).write_text(str(time.time()))
                time.sleep(HANG_S)
            apply(self, clock, *rest)

        ParameterServer._step = hang  # type: ignore[method-assign]
    try:
        result = train(job)
    except ps_wire.PeerHung:
        (Path(marks) / str(rank)).write_text(str(time.time()))
        raise
    return {"history": result.history}


def _timed_job(timeout_s: float, steps: int = 4, **ps: Any) -> JobConfig:
    return small_job(
        train={"steps": steps},
        parallel={"sync": "ps"},
        ps={"servers": 1, **ps},
        launch={"nproc": WORLD, "timeout_s": timeout_s},
    )


def test_a_hung_server_is_named_within_the_timeout(tmp_path: Path) -> None:
    timeout = 3.0
    with pytest.raises(RankFailure) as info:
        run_distributed(
            _run_with_hung_server, WORLD, _timed_job(timeout), str(tmp_path), timeout_s=300
        )
    message = str(info.value).splitlines()[0]
    assert re.match(
        r"rank [01] failed: PeerHung: rank 2 \(server0\) did not answer worker [01]'s pull of "
        r"step 4 within launch.timeout_s = 3 s",
        message,
    ), message
    hung = float((tmp_path / "2").read_text())
    named = min(float(p.read_text()) for p in tmp_path.iterdir() if p.name in ("0", "1"))
    # The timeout plus at most one heartbeat check (1 s), with room for two CPU hogs.
    assert timeout <= named - hung < timeout + 15, f"named {named - hung:.1f} s after the hang"


def test_a_server_waiting_for_a_straggler_is_not_called_hung() -> None:
    """SSP with staleness 0: the fast worker's pull waits for the straggler (4 s a step, longer
    than the 2 s timeout) while the server keeps serving; the job must finish. Two steps: the
    second step's pull is the wait past the timeout (the first pulls the initial weights)."""
    job = _timed_job(2.0, steps=2, mode="ssp", staleness=0, straggler_delay_s=4.0)
    out = run_distributed(_run, WORLD, job, timeout_s=300)
    assert "error" not in out[0] and "other" not in out[0], out[0]
    assert len(out[0]["history"]) == 2
    assert max(r["ps_wait_s"] for r in out[0]["history"]) > 2.0  # it did wait past the timeout


def test_colocated_skip_and_stop() -> None:
    """[Note: colocated servers]: a NaN step reaches the server threads like dedicated ones
    (skip: dropped and counted on both ranks' servers; stop: every rank names the step)."""
    job = _job("sync", "skip", world=2, servers=2, colocate=True)
    out = run_distributed(_run, 2, job, timeout_s=300)
    for rank in range(2):
        history = out[rank]["history"]
        assert [r["step"] for r in history if r.get("skipped")] == [3]
        assert history[-1]["ps_skipped_updates"] == 1.0  # this rank's server dropped it
    job = _job("sync", "stop", world=2, servers=2, colocate=True)
    out = run_distributed(_run, 2, job, timeout_s=300)
    for rank in range(2):
        assert "at step 3" in out[rank].get("error", ""), out[rank]
