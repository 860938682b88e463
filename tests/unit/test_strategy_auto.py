"""``strategy = "auto"``: a plan becomes exactly the job fields the trainer runs (contract 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytrain.config.io import job_from_dict
from polytrain.config.job import DataConfig, JobConfig, ModelConfig
from polytrain.errors import ConfigError
from polytrain.planner.types import Curve, HostProfile, Layout
from polytrain.trainer.auto import apply_layout, layout_of


def test_apply_layout_writes_the_plan_into_the_job() -> None:
    job = job_from_dict({"strategy": "auto", "launch": {"nproc": 4}})
    out = apply_layout(job, Layout(dp=2, pp=2, schedule="gpipe", microbatches=4))
    assert out.strategy == "manual"
    assert (out.parallel.dp, out.parallel.pp, out.launch.nproc) == (2, 2, 4)
    assert (out.pipeline.schedule, out.pipeline.microbatches) == ("gpipe", 4)
    ps = apply_layout(job, Layout(dp=2, sync="ps", ps_servers=1, ps_mode="async"))
    assert (ps.launch.nproc, ps.num_trainers, ps.ps.mode) == (3, 2, "async")
    # leaf servers round-trip: the layout of the job the plan wrote is the plan
    leafy = Layout(dp=4, sync="ps", ps_servers=1, ps_mode="sync", ps_leaves=2)
    out = apply_layout(job, leafy)
    assert (out.launch.nproc, out.ps.leaves) == (5, 2)
    assert layout_of(out) == leafy


def test_layout_of_inverts_apply_layout_recompute_included() -> None:
    job = job_from_dict({"strategy": "auto", "launch": {"nproc": 4}})
    for layout in (
        Layout(dp=4, recompute=True, recompute_every=2),
        Layout(dp=2, pp=2, microbatches=4, recompute=True),
        Layout(dp=2, tp=2, zero=3),
        Layout(dp=4, recompute=True, recompute_ops=True),
    ):
        assert layout_of(apply_layout(job, layout)) == layout
    ops = job_from_dict({"launch": {"nproc": 4}, "parallel": {"recompute": "ops"}})
    assert layout_of(ops) == Layout(dp=4, recompute=True, recompute_ops=True)


def test_strategy_is_validated() -> None:
    with pytest.raises(ConfigError, match="strategy = 'bogus'"):
        job_from_dict({"strategy": "bogus"})


def test_auto_picks_a_runnable_layout(tmp_path: Path) -> None:
    from polytrain.trainer.auto import resolve_auto
    from polytrain.trainer.preflight import preflight

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    job = JobConfig(
        strategy="auto", model=ModelConfig(name="mlp"), data=DataConfig(source=str(corpus))
    )
    job.launch.nproc = 2
    fast_link = Curve(((4096.0, 1e-5), (2.0**26, 1e-2)))
    profile = HostProfile(
        fingerprint="test",
        device="cpu",
        matmul_flops={"fp32": 1e10, "bf16": 1e10},
        mem_bw=1e10,
        collectives={op: {2: fast_link} for op in ("all_reduce", "all_gather", "p2p")},
    )
    choice = resolve_auto(job, profile)
    assert choice.job.strategy == "manual"
    assert 1 <= choice.job.world_size <= 2
    assert choice.prediction.step_s > 0 and choice.prediction.fits
    for key, value in choice.layout.overrides().items():
        section, name = key.split(".")
        assert getattr(getattr(choice.job, section), name) == value
    preflight(choice.job)  # the trainer accepts what the planner chose
