"""[Note: host drift] in planner/drift.py: a profile rescaled to the host's speed now, and the
commands that time it (`polytrain calibrate --check`, `polytrain plan --validate`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polytrain.cli import calibrate as calibrate_cli
from polytrain.cli import plan as plan_cli
from polytrain.cli.app import app
from polytrain.measure.calibrate import _with_speed
from polytrain.measure.host import host_identity, speed_rates, speed_rounds, speed_sample
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.drift import (
    SPEED_FIGURES,
    SPEED_SPREAD,
    describe,
    drifted,
    rescaled,
    speed_ratios,
)
from polytrain.planner.profile_io import fingerprint, profile_path, save_profile
from polytrain.planner.stats_pure import gpt_stats
from polytrain.planner.types import Curve, HostProfile, Layout
from tests.helpers.planner import cpu_profile

SPEED = {"matmul fp32": 1.6e11, "matmul half": 1.1e12, "operator": 1000.0, "copy": 1e10}
PROFILE = cpu_profile(
    matmul_flops={"fp32": 10e9, "bf16": 40e9},
    matmul_by_size={"fp32": {256: 8e9, 1024: 10e9}, "bf16": {1024: 40e9}},
    gemm_by_size={64: 5e9},
    attention_rates={(32, 32): (3e9, 2e9)},
    elementwise_s={"aten.gelu": 1e-9},
    step_costs={"adamw": (2e-5, 3e-10)},
    op_s=5e-6,
    loop_step_s=3e-4,
    loop_microbatch_s=1e-4,
    fsdp_unit_s={2: 6e-4},
    fsdp_tensor_s={2: 5e-5},
    tp_module_s=4e-4,
    pipe_action_s={"1f1b": 2e-4},
    pipe_flush_s={"1f1b": 5e-4},
    collectives={"all_reduce": {2: Curve(((16.0, 1e-3), (2**20, 5e-3)))}},
    tp_in_step={2: Curve(((1e3, 1e-3),))},
    reduce_in_step={2: 4e-4},
    sync_wait_s={2: 6e-4},
    step_skew={2: 0.03},
    dtensor_clip_call_s={2: 2e-3},
    ps_exchange_s={"sync": {1: 2e-3}},
    speed=SPEED,
)


def test_ratios_compare_the_figures_both_sides_have() -> None:
    now = {"matmul fp32": 0.8e11, "operator": 1250.0, "copy": 0.0, "elsewhere": 1.0}
    ratios = speed_ratios(SPEED, now)
    assert ratios == {"matmul fp32": pytest.approx(0.5), "operator": pytest.approx(1.25)}
    assert drifted(ratios) == ["matmul fp32", "operator"]
    assert drifted({"matmul fp32": 0.9, "copy": 1.1}) == []
    assert describe(ratios) == "matmul fp32 0.50x, operator 1.25x"
    assert describe({}) == "not measured"


def test_a_profile_at_its_own_speed_is_itself() -> None:
    assert rescaled(PROFILE, {}) is PROFILE
    assert rescaled(PROFILE, dict.fromkeys(SPEED_FIGURES, 1.0)) == PROFILE


def test_each_family_moves_with_its_figure_and_the_wire_stays() -> None:
    """Half the matmul speed halves every matmul-family rate, an operator 1.25x as fast cuts
    every per-call figure to 0.8, a copy 2x as fast halves the per-byte seconds; collectives,
    in-step curves and the parameter-server exchange are left as measured."""
    slow = rescaled(PROFILE, {"matmul fp32": 0.5, "matmul half": 0.25, "operator": 1.25, "copy": 2})
    assert slow.matmul_flops == {"fp32": 5e9, "bf16": 10e9}
    assert slow.matmul_by_size == {"fp32": {256: 4e9, 1024: 5e9}, "bf16": {1024: 10e9}}
    assert slow.matmul_concurrent == {1: 5e9, 2: 3e9, 4: 1e9}
    assert slow.gemm_by_size == {64: 2.5e9}
    assert slow.attention_rates == {(32, 32): (1.5e9, 1e9)}
    assert slow.mem_bw == 2e10 and slow.elementwise_s == {"aten.gelu": 5e-10}
    assert slow.step_costs == {"adamw": (pytest.approx(1.6e-5), 1.5e-10)}
    assert slow.op_s == pytest.approx(4e-6)
    assert (slow.loop_step_s, slow.loop_microbatch_s) == (pytest.approx(2.4e-4), 8e-5)
    assert slow.fsdp_unit_s == {2: pytest.approx(4.8e-4)}
    assert slow.fsdp_tensor_s == {2: pytest.approx(4e-5)}
    assert slow.tp_module_s == pytest.approx(3.2e-4)
    assert slow.pipe_action_s == {"1f1b": pytest.approx(1.6e-4)}
    assert slow.pipe_flush_s == {"1f1b": pytest.approx(4e-4)}
    assert slow.speed["matmul fp32"] == 0.8e11  # the figures describe the host now
    wire = ("collectives", "tp_in_step", "fsdp_in_step", "reduce_in_step", "ps_exchange_s")
    wire += ("dtensor_clip_call_s",)  # mostly its norm's all-reduce: [Note: DTensor clip per call]
    wire += ("sync_wait_s",)  # the others' stalls: [Note: ranks' skew]
    for same in (*wire, "step_slowdown", "step_skew"):  # shares of the step: no speed in them
        assert getattr(slow, same) == getattr(PROFILE, same)


def test_processes_at_once_move_with_the_all_core_figure() -> None:
    """One process 1.5x as fast, every core together as fast as before: the concurrent rates
    stay, one alone's rises, and the step slowdown grows so that n at once price as before."""
    shared = replace(PROFILE, step_slowdown={2: 1.1, 4: 2.2})
    ratios = {"matmul fp32": 1.5, "matmul fp32, all cores": 1.0}
    fast = rescaled(shared, ratios)
    assert fast.matmul_concurrent == {1: 15e9, 2: 6e9, 4: 2e9}
    assert fast.step_slowdown == {2: pytest.approx(1.65), 4: pytest.approx(3.3)}
    stats = gpt_stats(n_layer=2, n_embd=512, n_head=8, block_size=64, vocab_size=256)

    def compute(profile: HostProfile, n: int) -> float:
        env = Env(parse_cluster(f"1x{n}xcpu"), profile=profile)
        return predict(Layout(dp=n), stats, env, 8).breakdown["compute"]

    assert compute(fast, 1) == pytest.approx(compute(shared, 1) / 1.5, rel=0.02)
    assert compute(fast, 2) == pytest.approx(compute(shared, 2), rel=0.02)


def test_a_slower_host_prices_a_compute_bound_step_slower() -> None:
    """gpt with wide blocks on one process: most of the step is matmuls, so half the matmul
    speed costs nearly twice the time, and the operator figure alone moves it little."""
    stats = gpt_stats(n_layer=2, n_embd=512, n_head=8, block_size=64, vocab_size=256)
    env = Env(parse_cluster("1x1xcpu"), profile=PROFILE)
    base = predict(Layout(), stats, env, 8).step_s
    slow = predict(
        Layout(), stats, replace(env, profile=rescaled(PROFILE, {"matmul fp32": 0.5})), 8
    )
    assert 1.6 * base < slow.step_s < 2.0 * base
    ops = predict(Layout(), stats, replace(env, profile=rescaled(PROFILE, {"operator": 0.5})), 8)
    assert base < ops.step_s < 1.3 * base


def test_calibration_keeps_the_speed_of_its_matmul_rounds_and_how_far_it_moved() -> None:
    """The figures are the rounds timed beside the matmuls'; how far the host moved is the
    largest of their rounds' spreads and of the end sample's distance from them."""
    rounds = {name: (rate, 0.05) for name, rate in SPEED.items()}
    profile = _with_speed(replace(PROFILE, speed={}), rounds, dict(SPEED))
    assert profile.speed == SPEED and profile.spread[SPEED_SPREAD] == pytest.approx(0.05)
    rounds["copy"] = (SPEED["copy"], 0.3)
    profile = _with_speed(replace(PROFILE, speed={}), rounds, dict(SPEED))
    assert profile.spread[SPEED_SPREAD] == pytest.approx(0.3)
    end = {**SPEED, "operator": 600.0}  # slower by the end: the late figures were measured so
    profile = _with_speed(replace(PROFILE, speed={}), rounds, end)
    assert profile.speed == SPEED and profile.spread[SPEED_SPREAD] == pytest.approx(0.4)


def test_the_speed_sample_times_every_figure() -> None:
    sample = speed_sample(budget_s=0.02)
    assert set(sample) == set(SPEED_FIGURES)
    assert all(v > 0 for v in sample.values())
    rates = speed_rates(speed_rounds(budget_s=0.02))
    assert set(rates) == set(SPEED_FIGURES) and all(r > 0 and s >= 0 for r, s in rates.values())


def _saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, speed: dict[str, float]) -> None:
    monkeypatch.setenv("POLYTRAIN_CACHE", str(tmp_path))
    path = profile_path(fingerprint(host_identity(1)), tmp_path)
    profile = replace(PROFILE, fingerprint=fingerprint(host_identity(1)), speed=speed)
    save_profile(profile, path, host_identity(1))


def test_calibrate_check_says_whether_the_host_still_runs_at_its_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(tmp_path, monkeypatch, SPEED)
    runner = CliRunner()
    monkeypatch.setattr(calibrate_cli, "speed_sample", lambda threads: dict(SPEED))
    same = runner.invoke(app, ["calibrate", "--check"])
    assert same.exit_code == 0, same.output
    assert "matmul fp32 1.00x" in same.output and "moved more" not in same.output
    slow = {**SPEED, "operator": 700.0}
    monkeypatch.setattr(calibrate_cli, "speed_sample", lambda threads: dict(slow))
    moved = runner.invoke(app, ["calibrate", "--check"])
    assert moved.exit_code == 1
    assert "operator 0.70x" in moved.output and "operator moved more than 15%" in moved.output
    _saved(tmp_path, monkeypatch, {})  # an older profile: nothing to compare
    old = runner.invoke(app, ["calibrate", "--check"])
    assert old.exit_code == 1 and "no speed figures" in old.output


def test_plan_validate_prices_this_host_at_its_speed_now(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_cli, "speed_sample", lambda threads: {**SPEED, "matmul fp32": 0.8e11})
    now, line = plan_cli.at_present_speed(PROFILE)
    assert now.matmul_flops["fp32"] == 5e9
    assert "matmul fp32 0.50x" in line and "moved past 15%" in line and "rescaled" in line
    old, line = plan_cli.at_present_speed(replace(PROFILE, speed={}))
    assert old.matmul_flops["fp32"] == 10e9 and "no speed figures" in line
