"""[Note: pipeline runtime overhead] in measure/calibrate_worker.py: the pipeline runtime's own
cost priced in every F and B and once per flush, and the fit that calibration makes of it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from polytrain.measure.calibrate_worker import (
    PIPE_MICROBATCHES,
    fit_pipeline_runtime,
    pipeline_probe_job,
)
from polytrain.measure.stats import model_stats
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.stats_pure import gpt_stats
from polytrain.planner.types import HostProfile, Layout
from tests.helpers.planner import cpu_profile

STATS = gpt_stats(n_layer=4, n_embd=64, n_head=4, block_size=16, vocab_size=64)
ACTION, FLUSH = 2e-4, 5e-4
# ranks that share no cores: the stages' compute stays put whatever the runtime adds
# ([Note: a pipeline's shared cores] in cost/stages.py shares the cores among the stages computing)
UNSHARED = {1: 10e9, 2: 10e9, 4: 10e9}


def _priced(layout: Layout, profile: HostProfile, cluster: str = "1x4xcpu") -> float:
    env = Env(parse_cluster(cluster).with_size(layout.devices), profile=profile)
    return predict(layout, STATS, env, 16).step_s


def _extra(layout: Layout, schedule: str | None = None) -> float:
    """Step with the runtime's terms for ``schedule`` (the layout's) - step without."""
    name = schedule or layout.schedule
    runtime = cpu_profile(
        pipe_action_s={name: ACTION}, pipe_flush_s={name: FLUSH}, matmul_concurrent=UNSHARED
    )
    return _priced(layout, runtime) - _priced(layout, cpu_profile(matmul_concurrent=UNSHARED))


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
    runtime = cpu_profile(
        pipe_action_s={"pipedream": ACTION},
        pipe_flush_s={"pipedream": FLUSH},
        matmul_concurrent=UNSHARED,
    )
    env = Env(parse_cluster("1x2xcpu"), profile=runtime)
    breakdown = predict(layout, STATS, env, 16).breakdown
    assert breakdown["pipeline_runtime"] == pytest.approx(extra)


def test_a_schedule_the_profile_did_not_measure_and_spmd_layouts_pay_nothing() -> None:
    assert _extra(Layout(pp=2, schedule="gpipe", microbatches=4), schedule="1f1b") == 0.0
    assert _extra(Layout(dp=2), schedule="1f1b") == 0.0


def test_the_fit_recovers_what_the_model_would_have_to_add() -> None:
    """Measurements the cost model itself makes with known figures (every round alike) fit back
    to those figures, within 2% (on shared cores the price is not quite linear in them: the
    ranks' utilization moves with the runtime's share, [Note: a pipeline's shared cores]); a
    measurement below the bare price fits no negative action."""
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
        assert actions[schedule] == pytest.approx(ACTION, rel=0.02)
        assert flushes[schedule] == pytest.approx(FLUSH, rel=0.02, abs=1e-6)
        assert spreads[f"pipeline runtime {schedule}"] == pytest.approx(0.0, abs=1e-9)
    faster = {(s, m): [step_s(s, m, 0.0, 0.0) * 0.5] * 3 for s, m in measured}
    actions, flushes, _ = fit_pipeline_runtime(base, faster)
    assert actions == {"gpipe": 0.0, "pipedream": 0.0} and flushes == actions


def test_a_pipeline_on_shared_cores_computes_as_its_busy_stages_share_them() -> None:
    """[Note: a pipeline's shared cores]: GPipe's 4 stages with one micro-batch each compute
    one rank at a time: priced as one rank alone (the step's end, which all four run at once,
    keeps the host's full count). 1F1B's 2 stages over 8 micro-batches compute together in
    the steady state and alone in the fill and drain: between one alone and two at once."""
    shared = cpu_profile()  # 10, 6 and 2 GFLOP/s each with 1, 2 and 4 at once

    def compute(layout: Layout, profile: HostProfile) -> float:
        env = Env(parse_cluster("1x4xcpu").with_size(layout.devices), profile=profile)
        return predict(layout, STATS, env, 16).breakdown["compute"]

    lone = Layout(pp=4, schedule="gpipe", microbatches=1)
    alone = cpu_profile(matmul_concurrent=UNSHARED)
    assert compute(lone, shared) == pytest.approx(compute(lone, alone), rel=0.01)
    busy = Layout(pp=2, schedule="1f1b", microbatches=8)
    ratio = compute(busy, shared) / compute(busy, alone)
    assert 1.3 < ratio < 10 / 6  # two at once would be 10 / 6
