"""``polytrain calibrate --quick``: measures this host into a cache dir, then reuses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.planner.drift import SPEED_FIGURES, SPEED_SPREAD
from polytrain.planner.profile_io import load_profile
from tests.helpers.cli import run_main


def _calibrate(cache: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """A measuring run, in its own process as a user's would be (its figures are this host's
    with nothing else loaded in the process)."""
    env = {**os.environ, "POLYTRAIN_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "polytrain.cli.app", "calibrate", "--quick", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _calibrate_here(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[int, str, str]:
    """The same command in this process: for the runs that measure nothing (a reuse, a refusal),
    where a new interpreter would only add its start-up."""
    monkeypatch.setenv("POLYTRAIN_CACHE", str(cache))
    return run_main(["calibrate", "--quick", *flags], capsys)


@pytest.mark.slow
def test_quick_calibration_saves_a_sane_profile_and_reuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _calibrate(tmp_path)
    assert first.returncode == 0, first.stderr
    (path,) = tmp_path.glob("host-*.json")
    profile = load_profile(path)
    assert all(v > 1e8 for v in profile.matmul_flops.values())  # > 0.1 GFLOP/s
    assert set(profile.matmul_flops) == {"fp32", "bf16"}
    assert profile.mem_bw > 1e8
    assert set(profile.matmul_concurrent) == {1, 2} and min(profile.matmul_concurrent.values()) > 0
    assert profile.startup_s > 0 and profile.baseline_bytes > 50 * 2**20
    # torch._dynamo alone ([Note: a worker's own memory] in planner/memory.py)
    assert profile.runtime_bytes > 10 * 2**20
    ops = {"all_reduce", "all_gather", "reduce_scatter", "p2p", "p2p_posted"}
    assert set(profile.collectives) == ops
    for by_world in profile.collectives.values():
        curve = by_world[2]
        assert len(curve.points) == 3 and all(s > 0 for _, s in curve.points)
        assert curve.bandwidth > 0  # (no ordering by size: a descheduled rank can invert it)
    parts = {"check", "clip", "adamw", "sgd"}  # and on DTensors ([Note: DTensor end of step])
    fused = {"adamw_fused", "sgd_fused"}  # a parameter server's ([Note: fused server optimizer])
    assert set(profile.step_costs) == parts | fused | {f"dtensor {part}" for part in parts}
    assert profile.step_costs["dtensor adamw"][0] > 0  # DTensor's dispatch per tensor
    assert profile.tp_module_s >= 0  # [Note: DTensor module overhead]
    # [Note: tensor-parallel collectives in a step]: groups of two, 2 ranks (quick plan), at the
    # probe's two activation sizes
    assert set(profile.tp_in_step) == {2}
    assert [b for b, _ in profile.tp_in_step[2].points] == [32 * 128 * 4.0, 2048 * 128 * 4.0]
    assert all(s >= 0 for _, s in profile.tp_in_step[2].points)
    assert "tp all-reduce" in first.stdout
    # [Note: shared cores, measured on a step]: two processes at once, a positive factor
    assert set(profile.step_slowdown) == {2} and profile.step_slowdown[2] > 0
    # [Note: ranks' skew]: seconds per synchronization and a share of the compute between,
    # per world size the plan runs
    assert set(profile.sync_wait_s) == {2} and 0 <= profile.sync_wait_s[2] < 0.1
    assert set(profile.step_skew) == {2} and 0 <= profile.step_skew[2] < 1
    # [Note: DTensor clip per call]: seconds per call on a mesh of each world size
    assert set(profile.dtensor_clip_call_s) == {2} and 0 <= profile.dtensor_clip_call_s[2] < 1
    assert "waiting for the slowest of 2 ranks" in first.stdout
    # [Note: the step's reductions in a step]: per world size the plan runs
    assert set(profile.reduce_in_step) == {2} and profile.reduce_in_step[2] >= 0
    assert "end of step's all-reduce" in first.stdout
    assert all(a >= 0 and b >= 0 for a, b in profile.step_costs.values())
    assert any(a > 0 or b > 0 for a, b in profile.step_costs.values())
    assert profile.op_s > 0
    # [Note: cold operands], [Note: attention kernels] in measure/kernels.py
    assert set(profile.gemm_by_size) == {32, 128} and min(profile.gemm_by_size.values()) > 0
    assert set(profile.attention_rates) == {(16, 16), (32, 16)}
    assert all(f > 0 and b > 0 for f, b in profile.attention_rates.values())
    assert profile.elementwise_s["aten.gelu"] > 0  # [Note: elementwise kernels]
    assert set(profile.fsdp_unit_s) == {0, 2, 3} and all(
        v >= 0 for v in profile.fsdp_unit_s.values()
    )
    # [Note: FSDP2 tensor overhead]: per stage, per tensor past a one-Linear unit's two
    assert set(profile.fsdp_tensor_s) == {0, 2, 3}
    assert all(v >= 0 for v in profile.fsdp_tensor_s.values())
    assert "FSDP2 per tensor, zero 2" in first.stdout
    # [Note: loop overhead] and [Note: timing rounds]: measured, and the table shows them
    assert profile.loop_step_s >= 0 and profile.loop_microbatch_s >= 0
    # [Note: pipeline runtime overhead]: the quick plan's one schedule, fitted, shown
    assert set(profile.pipe_action_s) == set(profile.pipe_flush_s) == {"1f1b"}
    assert profile.pipe_action_s["1f1b"] >= 0 and profile.pipe_flush_s["1f1b"] >= 0
    assert "pipeline runtime" in first.stdout and "pipeline runtime 1f1b" in profile.spread
    # [Note: parameter-server exchange]: one worker at one server, both modes (quick plan)
    assert {m: set(by_n) for m, by_n in profile.ps_exchange_s.items()} == {
        "sync": {1},
        "async": {1},
    }
    assert all(v >= 0 for by_n in profile.ps_exchange_s.values() for v in by_n.values())
    assert "parameter server" in first.stdout
    assert {"matmul fp32 256", "memory bandwidth", "training loop"} <= set(profile.spread)
    assert all(v >= 0 for v in profile.spread.values())
    assert (
        "aten.gelu" in first.stdout and "Linear" in first.stdout
    )  # the kernels' rows (one word each)
    assert "spread" in first.stdout  # (one word: rich wraps the table at spaces)
    assert json.loads(path.read_text())["identity"]["torch"]
    # [Note: host drift] in planner/drift.py: timed at the start and the end, the mean kept
    assert set(profile.speed) == set(SPEED_FIGURES) and min(profile.speed.values()) > 0
    assert profile.spread[SPEED_SPREAD] >= 0 and "speed figures" in first.stdout
    stamp = path.stat().st_mtime_ns

    # same hardware and torch: the saved profile is reused
    code, out, err = _calibrate_here(tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "reused" in out or "measured earlier" in out
    assert path.stat().st_mtime_ns == stamp


def test_a_cache_dir_that_is_a_file_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory")
    code, _, err = _calibrate_here(blocker, monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"polytrain: error: profile cache {str(blocker)!r} is a file, not a directory: pass "
        "--cache-dir DIR or set POLYTRAIN_CACHE to a directory"
    ]
    assert blocker.read_text() == "not a directory"  # nothing overwritten


def test_check_without_a_saved_profile_says_so_and_measures_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _calibrate_here(tmp_path, monkeypatch, capsys, "--check")
    assert code == 2, err
    assert "no saved profile of this host" in err and "polytrain calibrate" in err
    assert len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("host-*.json"))  # nothing was measured or saved
