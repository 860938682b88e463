"""Each memory or consistency feature shows its effect, not only parity (STYLE 19; issue 10).

- recomputation holds less activation memory than storing activations (SPMD and pipeline),
- ZeRO-3 holds ~1/dp of the parameters through the forward, ZeRO-2 the whole (and inside
  pipeline stages, ZeRO-2 keeps them whole across micro-batches),
- async and SSP parameter servers admit staleness above 0 with a straggler, SSP never above s.

Memory is read by probes placed in the model (tests/helpers/probes.py) during real training
steps on 2 gloo ranks.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from polytrain.config import JobConfig
from polytrain.ps import check_staleness_trace
from polytrain.testing import run_distributed
from tests.conftest import small_job
from tests.helpers import probes

pytestmark = pytest.mark.slow

STEPS = 3


def _train_probed(rank: int, world_size: int, job: JobConfig) -> dict[str, Any]:
    from polytrain.trainer.loop import train
    from tests.helpers import probes

    probes.READINGS.clear()
    result = train(job)
    return {"readings": list(probes.READINGS), "history": result.history}


def _probed(model: str, **sections: dict[str, Any]) -> list[dict[str, Any]]:
    job = small_job(
        model={"name": f"tests.helpers.probes:{model}", "block_size": probes.BLOCK_SIZE},
        train={"steps": STEPS, "global_batch_size": 32},
        launch={"nproc": 2},
        **sections,
    )
    return run_distributed(_train_probed, 2, job, timeout_s=180)


def _steps(readings: list[tuple[str, int]], starts_per_step: int) -> list[list[tuple[str, int]]]:
    """The readings split into training steps; each step opens with ``starts_per_step`` start
    probes (one per micro-batch)."""
    opens = [i for i, (kind, _) in enumerate(readings) if kind == "start"]
    assert len(opens) == STEPS * starts_per_step, f"probe calls {readings}"
    bounds = [*opens[::starts_per_step], len(readings)]
    return [readings[a:b] for a, b in itertools.pairwise(bounds)]


def _activation_peak(readings: list[tuple[str, int]], starts_per_step: int) -> int:
    """Largest growth of the heap over a step's first reading, after the first step (which
    also allocates gradients and optimizer state for good)."""
    return max(
        max(v for _, v in step) - step[0][1] for step in _steps(readings, starts_per_step)[1:]
    )


# -- recomputation ---------------------------------------------------------------------------

TOKENS = 16 * probes.BLOCK_SIZE  # per rank (dp 2) or per micro-batch (pp 2, 2 micro-batches)


@pytest.mark.parametrize(
    ("layout", "model", "starts_per_step"),
    [
        ({"parallel": {"dp": 2}}, "activations", 1),
        (
            {
                "parallel": {"pp": 2},
                "pipeline": {"schedule": "gpipe", "microbatches": 2, "partition": [5, 5]},
            },
            "activations_two_stages",
            2,
        ),
    ],
    ids=["spmd-dp2", "pipeline-gpipe"],
)
def test_recompute_holds_less_activation_memory(
    layout: dict[str, Any], model: str, starts_per_step: int
) -> None:
    """4 MLP blocks' activations per rank (dp: 4 blocks on one batch; gpipe: 2 blocks on each
    of 2 micro-batches held together). Stored, each block keeps ~9 floats per token and width
    unit; recomputed, only its 1-float input."""
    peaks = {}
    for recompute in (False, True):
        sections = {**layout, "parallel": {**layout["parallel"], "recompute": recompute}}
        ranks = _probed(model, **sections)
        peaks[recompute] = [_activation_peak(r["readings"], starts_per_step) for r in ranks]
    stored = 4 * probes.saved_bytes_per_mlp(TOKENS)
    for rank in range(2):
        plain, recomputed = peaks[False][rank], peaks[True][rank]
        # The probes see the activations the model stores (not allocator noise)...
        assert plain >= 0.8 * stored, (rank, peaks, stored)
        # ...and recomputation keeps a small part of them: ~1/9 plus the embedding's output.
        assert recomputed <= 0.3 * plain, (rank, peaks)


# -- ZeRO-2 against ZeRO-3 -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("zero", "at_rest", "after_forward"),
    [(0, 1.0, 1.0), (2, 0.5, 1.0), (3, 0.5, 0.5)],
    ids=["dp", "zero2", "zero3"],
)
def test_zero_stage_sets_parameter_residency(
    zero: int, at_rest: float, after_forward: float
) -> None:
    """Bytes the MLP blocks' parameters hold on each of 2 ranks, read at the start of a step's
    forward (at rest: after the previous update) and at its end (before backward).

    ZeRO-3 frees each block's gathered parameters after its forward: ~1/dp throughout. ZeRO-2
    keeps them gathered from forward to backward (no second all-gather): the whole model by the
    end of the forward, as in ZeRO-2's replicated parameters. Both hold only their shard between
    steps (FSDP2 reshards after backward; polytrain.parallel.zero), which plain data parallel
    does not."""
    whole = probes.mlp_param_bytes()
    ranks = _probed("residency", parallel={"dp": 2, "zero": zero})
    for rank, out in enumerate(ranks):
        for step in _steps(out["readings"], 1)[1:]:
            readings = dict(step)
            assert readings["start"] == pytest.approx(at_rest * whole, rel=0.02), (rank, step)
            assert readings["end"] == pytest.approx(after_forward * whole, rel=0.02), (rank, step)


@pytest.mark.parametrize("zero", [2, 3], ids=["zero2", "zero3"])
def test_zero_inside_stages_sets_parameter_residency(zero: int) -> None:
    """dp 2 x pp 2, GPipe with 2 micro-batches ([Note: ZeRO inside stages]): bytes a stage's 2
    MLP blocks hold at the start and the end of each micro-batch's forward. ZeRO-3 holds ~1/dp
    throughout (each block gathered for its own forward only). ZeRO-2 starts the step at 1/dp
    and gathers the stage once: whole from the first forward's end, and still whole when the
    second micro-batch starts (kept across micro-batches until the step's last backward)."""
    job = small_job(
        model={
            "name": "tests.helpers.probes:residency_two_stages",
            "block_size": probes.BLOCK_SIZE,
        },
        parallel={"dp": 2, "pp": 2, "zero": zero},
        pipeline={"schedule": "gpipe", "microbatches": 2, "partition": [5, 5]},
        train={"steps": STEPS, "global_batch_size": 32},
        launch={"nproc": 4},
    )
    stage = probes.mlp_param_bytes() // 2  # 2 of the 4 MLP blocks
    expected = [0.5] * 4 if zero == 3 else [0.5, 1.0, 1.0, 1.0]
    for rank, out in enumerate(run_distributed(_train_probed, 4, job, timeout_s=180)):
        for step in _steps(out["readings"], 2)[1:]:
            values = [v / stage for _, v in step]
            assert [kind for kind, _ in step] == ["start", "end"] * 2, (rank, step)
            assert values == pytest.approx(expected, rel=0.02), (rank, values)


# -- parameter-server staleness ----------------------------------------------------------------


def _ps_ranks(rank: int, world_size: int, job: JobConfig) -> list[dict[str, Any]]:
    from polytrain.trainer.loop import train

    return train(job).history


@pytest.mark.parametrize(("mode", "bound"), [("async", None), ("ssp", 2)])
def test_straggler_makes_staleness_above_zero_and_ssp_bounds_it(
    tmp_path: Path, mode: str, bound: int | None
) -> None:
    """Worker 1 sleeps 0.1 s per step (``ps.straggler_delay_s``); worker 0 runs ahead, so the
    parameters it pulls lag its own clock. Read from each worker's recorded ``ps_staleness`` and
    from the server's grant log; SSP's bound caps both."""
    steps = 20
    job = small_job(
        parallel={"sync": "ps"},
        ps={
            "servers": 1,
            "mode": mode,
            "staleness": bound or 0,
            "straggler_delay_s": 0.1,
        },
        launch={"nproc": 3},
        train={"steps": steps},
        observe={"out_dir": str(tmp_path), "log_every": 1},
    )
    histories = run_distributed(_ps_ranks, 3, job, timeout_s=180)
    staleness = [[r["ps_staleness"] for r in h if "ps_staleness" in r] for h in histories[:2]]
    assert [len(s) for s in staleness] == [steps, steps]
    fast, straggler = staleness
    assert max(fast) > 0, staleness  # the fast worker really ran ahead of the straggler
    server = json.loads((tmp_path / "ps" / "server0.json").read_text())
    events = [tuple(e) for e in server["events"]]
    assert max(clock - floor for _, clock, floor in events) > 0
    if bound is None:
        # async has no bound: the fast worker gets further ahead than SSP would allow
        assert max(fast) > 2, staleness
    else:
        assert max(fast + straggler) <= bound, staleness
        assert check_staleness_trace(events, bound) == []
