"""ZeRO inside pipeline stages (dp 2 x pp 2, FSDP2 over each stage's replicas) reproduces the
single-process run parameter by parameter ([Note: ZeRO inside stages] in pipeline.sharded).

1F1B, GPipe and interleaved 1F1B with ZeRO-2 and ZeRO-3 on the tiny GPT, global-norm clipping with AdamW,
accumulation with recomputation; each stage reduce-scatters once per step (ZeRO-2 also gathers
once, ZeRO-3 per micro-batch), the optimizer state is sharded, and a checkpoint resumes the
run exactly. Jobs of one world size share one set of processes.
"""

from __future__ import annotations

from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from polytrain.config import JobConfig
from polytrain.testing import assert_state_close, run_distributed
from tests.conftest import small_job
from tests.distributed.test_pipeline import run_jobs
from tests.helpers.resume import resumed_after_step_3

pytestmark = pytest.mark.slow

# gpt n_layer 2: [embedding, block, block, head] = 4 blocks, 2 per stage.
GPT: dict[str, Any] = {"name": "gpt", "n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16}
ADAM_CLIP: dict[str, Any] = {"name": "adamw", "lr": 0.01, "grad_clip": 0.5}
V2: dict[str, Any] = {"virtual_stages": 2}


def pipe(schedule: str, m: int, zero: int, **sections: Any) -> JobConfig:
    parallel = {"dp": 2, "pp": 2, "zero": zero, **sections.pop("parallel", {})}
    pipeline = {"schedule": schedule, "microbatches": m, **sections.pop("pipeline", {})}
    return small_job(
        model=GPT, parallel=parallel, pipeline=pipeline, launch={"nproc": 4}, **sections
    )


REFERENCES = {"gpt": small_job(model=GPT), "gpt-adam-clip": small_job(model=GPT, optim=ADAM_CLIP)}
CASES: dict[str, tuple[str, JobConfig]] = {
    "1f1b-zero2": ("gpt", pipe("1f1b", 4, 2)),
    "1f1b-zero3": ("gpt", pipe("1f1b", 4, 3)),
    # Evaluations between steps: ZeRO-2 frees what the forward-only pass gathered.
    "gpipe-zero2-eval": ("gpt", pipe("gpipe", 4, 2, train={"eval_every": 1})),
    "gpipe-zero3": ("gpt", pipe("gpipe", 4, 3)),
    "1f1b-zero3-adam-clip": ("gpt-adam-clip", pipe("1f1b", 4, 3, optim=ADAM_CLIP)),
    # Two stages per rank (one block each), each its own FSDP2 root; clipping over all four.
    "interleaved-v2-zero2": ("gpt", pipe("interleaved-1f1b", 4, 2, pipeline=V2)),
    "interleaved-v2-zero3-adam-clip": (
        "gpt-adam-clip",
        pipe("interleaved-1f1b", 4, 3, pipeline=V2, optim=ADAM_CLIP),
    ),
    "1f1b-zero2-accum2-recompute": (
        "gpt",
        pipe("1f1b", 2, 2, train={"grad_accum": 2}, parallel={"recompute": True}),
    ),
}


@cache
def outcomes(world: int) -> dict[str, dict[str, Any]]:
    names = [n for n, (_, job) in CASES.items() if job.world_size == world]
    jobs = [CASES[n][1] for n in names] if world > 1 else list(REFERENCES.values())
    return dict(zip(names if world > 1 else REFERENCES, run_jobs(jobs), strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(case: str) -> None:
    ref_name, job = CASES[case]
    out, ref = outcomes(4)[case], outcomes(1)[ref_name]
    m, zero = job.pipeline.microbatches, job.parallel.zero
    v = "-v2" if job.pipeline.virtual_stages > 1 else ""
    assert out["strategy"] == f"{job.pipeline.schedule}-pp2{v}-m{m}-dp2-zero{zero}"
    # AdamW divides by the root of tiny second moments, which magnifies reassociation noise.
    atol = 1e-4 if ref_name == "gpt-adam-clip" else 1e-5
    assert_state_close(out["state"], ref["state"], atol=atol)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert out["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-5)
    if job.optim.grad_clip:  # the clip was active, and its norm is the whole model's
        norms = [r["grad_norm"] for r in out["history"]]
        assert min(norms) > job.optim.grad_clip
        assert norms == pytest.approx([r["grad_norm"] for r in ref["history"]], rel=1e-4)


def _collectives_rank(rank: int, world_size: int, jobs: list[JobConfig]) -> list[dict[str, Any]]:
    """Count FSDP2's all-gathers and reduce-scatters inside each training step, and read the
    optimizer state's shapes, through the strategy directly."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from polytrain.comm.init import init_distributed
    from polytrain.core.strategy import step_result
    from polytrain.pipeline.strategy import PipelineStrategy
    from tests.helpers.strategies import job_strategy

    counts: Counter[str] = Counter()
    for name in ("all_gather_single", "reduce_scatter_single"):
        real = getattr(dist, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    ctx = init_distributed()
    outs = []
    for job in jobs:
        strategy = job_strategy(job, ctx)
        assert isinstance(strategy, PipelineStrategy) and strategy.sharding is not None
        steps = []
        for step in range(job.train.steps):
            counts.clear()
            step_result(strategy.train_step(step))
            steps.append(dict(counts))
        state = [
            (type(v).__name__, tuple(v.to_local().shape), tuple(v.shape))
            for entries in strategy.optimizer.state.values()
            for v in entries.values()
            if isinstance(v, DTensor) or (hasattr(v, "dim") and v.dim() > 0)
        ]
        units = len(strategy.stage.blocks)
        outs.append({"steps": steps, "units": units, "optimizer_state": state})
        strategy.full_state_dict()  # collective: every rank takes part
    return outs


def test_reduce_scatter_once_per_step_and_sharded_optimizer_state() -> None:
    """Each stage's blocks reduce-scatter once per step (not once per micro-batch); ZeRO-2
    gathers each block once per step, ZeRO-3 for every micro-batch's forward and backward;
    AdamW's moments are DTensor shards (half of each block's rows on each dp rank)."""
    adam = {"name": "adamw", "lr": 0.01}
    jobs = [pipe("1f1b", 4, z, train={"steps": 2}, optim=adam) for z in (2, 3)]
    per_rank = run_distributed(_collectives_rank, 4, jobs, timeout_s=120.0)
    m = 4
    for outs in per_rank:
        assert outs is not None
        zero2, zero3 = outs
        units = zero2["units"]
        assert units == 2
        for step in zero2["steps"]:
            assert step == {"all_gather_single": units, "reduce_scatter_single": units}
        for step in zero3["steps"]:
            assert step == {"all_gather_single": 2 * m * units, "reduce_scatter_single": units}
        for kind, local, full in zero2["optimizer_state"]:
            assert kind == "DTensor", kind
            assert local[0] in (full[0] // 2, (full[0] + 1) // 2), (local, full)


@pytest.mark.parametrize(
    ("zero", "pipeline"),
    [(3, {"schedule": "1f1b"}), (2, {"schedule": "interleaved-1f1b", **V2})],
    ids=["1f1b-zero3", "interleaved-v2-zero2"],
)
def test_checkpoint_resumes_exactly(tmp_path: Path, zero: int, pipeline: dict[str, Any]) -> None:
    """Saved every 3 steps (full tensors gathered over dp) and resumed from step 3: the same
    weights and losses as the uninterrupted run, AdamW's sharded moments included."""
    full, resumed = resumed_after_step_3(
        tmp_path,
        model=GPT,
        parallel={"dp": 2, "pp": 2, "zero": zero},
        pipeline={"microbatches": 2, **pipeline},
        launch={"nproc": 4},
        optim={"name": "adamw", "lr": 0.01},
    )
    assert resumed["start"] == 3
    assert_state_close(resumed["state"], full["state"], atol=1e-6)
    assert resumed["losses"] == pytest.approx(full["losses"][3:], abs=1e-6)
