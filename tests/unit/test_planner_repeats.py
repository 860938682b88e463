"""[Note: repeated calibrations]: `polytrain calibrate` measures the host several times and keeps
each figure's median (the measurements replaced by canned profiles: pure and fast)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polytrain.cli.app import app
from polytrain.measure import calibrate as cal
from polytrain.planner.profile_io import load_profile
from tests.helpers.planner import cpu_profile


def _canned(monkeypatch: pytest.MonkeyPatch, op_s: list[float]) -> None:
    """`calibrate`'s one measurement replaced: the n-th call answers a profile whose operator
    call is ``op_s[n]`` and reports one part."""
    calls = iter(op_s)

    def measure(plan: cal.CalibrationPlan, threads: int, tell: object) -> object:
        assert callable(tell)
        tell("memory bandwidth")
        return replace(cpu_profile(), op_s=next(calls))

    monkeypatch.setattr(cal, "_measure", measure)


def test_each_figure_is_the_median_of_the_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    _canned(monkeypatch, [9e-6, 5e-6, 7e-6])
    heard: list[str] = []
    plan = replace(cal.CalibrationPlan.quick(), repeats=3)
    profile = cal.calibrate(plan, on_progress=heard.append)
    assert profile.op_s == 7e-6
    assert heard == [f"({n}/3) memory bandwidth" for n in (1, 2, 3)]
    once = replace(plan, repeats=1)
    assert cal.steps_of(plan) == 3 * cal.steps_of(once)
    _canned(monkeypatch, [9e-6])
    assert cal.calibrate(once, on_progress=heard.append).op_s == 9e-6
    assert heard[-1] == "memory bandwidth"  # one calibration: no "(1/1)"


def test_defaults_repeat_on_a_cpu_host_only() -> None:
    assert cal.CalibrationPlan().repeats == 3
    assert cal.CalibrationPlan.quick().repeats == 1
    assert cal.CalibrationPlan.accelerator().repeats == 1


def test_cli_repeats_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _canned(monkeypatch, [9e-6, 5e-6])
    out = CliRunner().invoke(
        app, ["calibrate", "--quick", "--repeats", "2", "--cache-dir", str(tmp_path)]
    )
    assert out.exit_code == 0, out.output
    assert "median of 2 calibrations" in out.output
    (path,) = tmp_path.glob("host-*.json")
    assert load_profile(path).op_s == pytest.approx(7e-6)
    bad = CliRunner().invoke(app, ["calibrate", "--quick", "--repeats", "0"])
    assert bad.exit_code == 2
