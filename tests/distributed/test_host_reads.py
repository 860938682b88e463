"""A training step reads no tensor on the host except where the loop logs (issue 36).

[Note: the step stays on the device] in polytrain.core.step. The real loop (`trainer.train`)
runs on 2 gloo ranks under `testing.HostReads`, which files every host read made by
polytrain's own code under the step the loop is in. On the CPU every tensor is a host tensor,
so this checks the GPU's rule where CI can run it.
"""

from __future__ import annotations

from typing import Any

import pytest

from polytrain.config import JobConfig
from polytrain.testing import run_distributed
from tests.conftest import small_job

pytestmark = pytest.mark.slow

STEPS, LOG_EVERY = 6, 3  # reads allowed on steps 3 and 6 (0-based 2 and 5)
# The first step sets channels up: a pipeline's p2p channel reads each peer's shape header
# once (comm/p2p.py), before any step's work is queued. Steps after it are checked.
FIRST_CHECKED = 1


def _reads_per_step(rank: int, world_size: int, job: JobConfig) -> dict[int, list[str]]:
    from polytrain.testing.host_reads import HostReads
    from polytrain.trainer import loop

    counter = HostReads()
    build = loop.build_strategy

    def counted(*args: Any, **kwargs: Any) -> Any:
        strategy = build(*args, **kwargs)
        step_fn = strategy.train_step

        def train_step(step: int) -> Any:
            counter.step = step  # reads until the next step's start are this step's
            return step_fn(step)

        strategy.train_step = train_step  # type: ignore[method-assign]
        return strategy

    loop.build_strategy = counted
    with counter:
        loop.train(job)
    return dict(counter.reads)


def _job(on_nonfinite: str, **sections: dict[str, Any]) -> JobConfig:
    train = {"steps": STEPS, "on_nonfinite": on_nonfinite, "eval_every": 0, "sample_tokens": 0}
    observe = {"log_every": LOG_EVERY, "progress": False}
    optim = {"name": "adamw", "grad_clip": 1.0}  # the default optimizer, fused; clipping on
    return small_job(train=train, observe=observe, optim=optim, launch={"nproc": 2}, **sections)


LAYOUTS = {
    "dp2": {"parallel": {"dp": 2}},
    "zero3": {"parallel": {"dp": 2, "zero": 3}},
    "tp2": {"parallel": {"tp": 2, "dp": 1}},
    "pp2-1f1b": {"parallel": {"pp": 2, "dp": 1}, "pipeline": {"schedule": "1f1b"}},
}


def _unlogged(reads: dict[int, list[str]]) -> dict[int, list[str]]:
    logged = {s for s in range(STEPS) if (s + 1) % LOG_EVERY == 0}
    return {s: r for s, r in reads.items() if FIRST_CHECKED <= s < STEPS and s not in logged and r}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_skip_reads_nothing_between_logged_steps(layout: str) -> None:
    job = _job("skip", **LAYOUTS[layout])
    for rank, reads in enumerate(run_distributed(_reads_per_step, 2, job, timeout_s=120)):
        assert not _unlogged(reads), f"rank {rank} of {layout}: {_unlogged(reads)}"
        # and the logged steps do read (the counter sees the loop's reads)
        assert reads.get(LOG_EVERY - 1), f"rank {rank} of {layout}: no read at a logged step"


def test_stop_reads_only_the_landed_flag() -> None:
    job = _job("stop", **LAYOUTS["dp2"])
    for rank, reads in enumerate(run_distributed(_reads_per_step, 2, job, timeout_s=120)):
        for step, where in _unlogged(reads).items():
            assert len(where) == 1 and "trainer/results.py" in where[0], (rank, step, where)
