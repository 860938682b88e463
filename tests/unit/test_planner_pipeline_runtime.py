"""[Note: pipeline runtime overhead] in planner/calibrate_worker.py: the pipeline runtime's own
cost priced in every F and B and once per flush, and the fit that calibration makes of it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from polytrain.planner.calibrate_worker import (
    PIPE_MICROBATCHES,
    fit_pipeline_runtime,
    pipeline_probe_job,
)
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.stats import model_stats
from polytrain.planner.stats_pure import gpt_stats
from polytrain.planner.types import HostProfile, Layout
from tests.helpers.planner import cpu_profile

STATS = gpt_stats(n_layer=4, n_embd=64, n_head=4, block_size=16, vocab_size=64)
ACTION, FLUSH = 2e-4, 5e-4


def _priced(layout: Layout, profile: HostProfile, cluster: str = "1x4xcpu") -> float:
    env = Env(parse_cluster(cluster).with_size(layout.devices), profile=profile)
    return predict(layout, STATS, env, 16).step_s


def _extra(layout: Layout, schedule: str | None = None) -> float:
    """Step with the runtime's terms for ``schedule`` (the layout's) - step without."""
    name = schedule or layout.schedule
    runtime = cpu_profile(pipe_action_s={name: ACTION}, pipe_flush_s={name: FLUSH})
    return _priced(layout, runtime) - _priced(layout, cpu_profile())


def test_every_f_and_b_and_every_flush_pay_the_runtime() -> None:
    """Equal stages, the catalog's tiny loopback messages: GPipe's and 1F1B's makespan is
    (m + p - 1) x (F + B), so it grows by (m + p - 1) x 2 actions, plus the flush; with gradient
    accumulation the runtime runs the program (and flushes) once per micro-step. The figures
    are priced as measured, whatever the ranks on the host (four here: not slowed)."""
    p, m = 2, 4
    for schedule in ("gpipe", "1f1b"):
        extra = _extra(Layout(pp=p, schedule=schedule, microbatches=m))
        assert extra == pytest.approx((m + p - 1) * 2 * ACTION + FLUSH, rel=0.02)
    extra = _extra(Layout(pp=p, schedule="1f1b", microbatches=m, grad_accum=2))
    assert extra == pytest.approx(2 * ((m + p - 1) * 2 * ACTION + FLUSH), rel=0.02)
    extra = _extra(Layout(pp=4, schedule="1f1b", microbatches=8))
    assert extra == pytest.approx((8 + 4 - 1) * 2 * ACTION + FLUSH, rel=0.02)


def test_pipedream_pays_its_steady_state_and_the_breakdown_names_the_runtime() -> None:
    """PipeDream never flushes: a step's m micro-batches cost each stage 2m actions more."""
    layout = Layout(pp=2, schedule="pipedream", microbatches=4)
    extra = _extra(layout)
    assert extra == pytest.approx(4 * 2 * ACTION + FLUSH, rel=0.02)
    runtime = cpu_profile(pipe_action_s={"pipedream": ACTION}, pipe_flush_s={"pipedream": FLUSH})
    env = Env(parse_cluster("1x2xcpu"), profile=runtime)
    breakdown = predict(layout, STATS, env, 16).breakdown
    assert breakdown["pipeline_runtime"] == pytest.approx(extra)


def test_a_schedule_the_profile_did_not_measure_and_spmd_layouts_pay_nothing() -> None:
    assert _extra(Layout(pp=2, schedule="gpipe", microbatches=4), schedule="1f1b") == 0.0
    assert _extra(Layout(dp=2), schedule="1f1b") == 0.0


def test_the_fit_recovers_what_the_model_would_have_to_add() -> None:
    """Measurements the cost model itself makes with known figures (every round alike) fit back
    to those figures; a measurement below the bare price fits no negative action."""
    base = cpu_profile(loop_step_s=3e-4, loop_microbatch_s=1e-4)
    stats = model_stats(pipeline_probe_job("1f1b", 2), device="cpu")
    host = parse_cluster("1x2xcpu")

    def step_s(schedule: str, m: int, action: float, flush: float) -> float:
        job = pipeline_probe_job(schedule, m)
        prof = replace(base, pipe_action_s={schedule: action}, pipe_flush_s={schedule: flush})
        env = Env(host, job.train.dtype, prof, job.parallel.bucket_mb * 2**20)
        layout = Layout(pp=2, schedule=schedule, microbatches=m)
        return predict(layout, stats, env, job.train.global_batch_size).step_s

    measured = {
        (s, m): [step_s(s, m, ACTION, FLUSH)] * 3
        for s in ("gpipe", "pipedream")
        for m in PIPE_MICROBATCHES
    }
    actions, flushes, spreads = fit_pipeline_runtime(base, measured)
    for schedule in ("gpipe", "pipedream"):
        assert actions[schedule] == pytest.approx(ACTION, rel=1e-3)
        assert flushes[schedule] == pytest.approx(FLUSH, rel=1e-3, abs=1e-9)
        assert spreads[f"pipeline runtime {schedule}"] == pytest.approx(0.0, abs=1e-9)
    faster = {(s, m): [step_s(s, m, 0.0, 0.0) * 0.5] * 3 for s, m in measured}
    actions, flushes, _ = fit_pipeline_runtime(base, faster)
    assert actions == {"gpipe": 0.0, "pipedream": 0.0} and flushes == actions
