"""``polytrain sched simulate`` in-process: results on a tiny trace, and every bad input as one
line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.scheduler import main as benchmark

from polytrain.scheduler.durations import parse_duration
from polytrain.scheduler.speedup import curve, planned_curves
from tests.helpers.cli import assert_usage_error, run_main

TINY = "id,submitted,duration,devices,min_devices\nJ1,0,100,2,2\nJ2,10,50,1,1\nJ3,20,30,1,1\n"


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.csv"
    path.write_text(TINY)
    return path


def simulate(trace: Path, *flags: str) -> list[str]:
    return ["sched", "simulate", "--trace", str(trace), "--devices", "2", *flags]


def test_json_has_every_policy_asked_with_its_figures(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(
        simulate(trace, "--policy", "fifo,srtf", "--policy", "fifo", "--json"), capsys
    )
    assert code == 0, err
    result = json.loads(out)
    assert list(result["policies"]) == ["fifo", "srtf"]
    fifo = result["policies"]["fifo"]
    assert fifo["avg_jct_s"] == pytest.approx(
        (100 + 140 + 110) / 3
    )  # tests/unit/test_sched_simulate.py
    assert fifo["makespan_s"] == pytest.approx(150.0) and fifo["p99_jct_s"] == pytest.approx(140.0)
    assert result["setup"]["jobs"] == 3 and result["setup"]["slice_s"] == 2400.0


def test_planner_curves_change_only_the_elastic_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--speedup planner: FIFO runs the job on its ask (its JCT does not depend on the curve);
    goodput, free to grow it to 2 devices, finishes it in duration / s(2) of the curve given."""
    one = tmp_path / "one.csv"
    one.write_text("id,submitted,duration,devices,model\nA,0,100,1,small\n")
    runs = {}
    for speedup in ("analytic", "planner:1x2xV100:nvlink2"):
        flags = ("--policy", "fifo,goodput", "--elastic", "2", "--speedup", speedup, "--json")
        code, out, err = run_main(simulate(one, *flags), capsys)
        assert code == 0, err
        runs[speedup] = json.loads(out)
    analytic, planner = runs["analytic"], runs["planner:1x2xV100:nvlink2"]
    assert planner["setup"]["speedup"] == "planner:1x2xV100:nvlink2"
    assert analytic["policies"]["fifo"]["avg_jct_s"] == planner["policies"]["fifo"]["avg_jct_s"]
    s2 = {"analytic": curve("small", 2)[2], "planner": planned_curves("1x2xV100:nvlink2")}
    assert analytic["policies"]["goodput"]["avg_jct_s"] == pytest.approx(100.0 / s2["analytic"])
    expected = 100.0 / s2["planner"]["small"][2]
    assert planner["policies"]["goodput"]["avg_jct_s"] == pytest.approx(expected)


def test_default_is_every_policy_as_a_table(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(simulate(trace, "--slice", "1h", "--restart", "0"), capsys)
    assert code == 0, err
    for name in ("fifo", "srtf", "tiresias", "gandiva", "goodput"):
        assert name in out
    assert "slice 3600 s, restart 0 s" in out


def test_cdf_is_written_once_and_never_overwritten(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "cdf.png"
    code, _, err = run_main(simulate(trace, "--policy", "fifo", "--cdf", str(png)), capsys)
    assert code == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG"
    code, _, err = run_main(simulate(trace, "--policy", "fifo", "--cdf", str(png)), capsys)
    assert_usage_error(code, err, "already exists")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--slice", "40x"], "--slice '40x'"),
        (["--slice", "0"], "--slice '0'"),
        (["--restart", "-1s"], "--restart '-1s'"),
        (["--policy", "lottery"], "--policy 'lottery': choose from fifo"),
        (["--sample", "9"], "--sample 9: give 1..3"),
        (["--speedup", "measured"], "--speedup 'measured': choose analytic, planner"),
        (["--speedup", "planner:1x1xV100"], "has 1 devices, 2 needed"),
        (["--speedup", "planner:3xZ"], "speed-up cluster '3xZ'"),
    ],
)
def test_bad_flags_are_one_line(
    trace: Path, flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(simulate(trace, *flags), capsys)
    assert_usage_error(code, err, named)


def test_bad_traces_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(
        ["sched", "simulate", "--trace", str(tmp_path / "no.csv"), "--devices", "2"], capsys
    )
    assert_usage_error(code, err, "does not exist")
    big = tmp_path / "big.csv"
    big.write_text("id,submitted,duration,devices\na,0,10,1\nwide,1,10,4\n")
    code, _, err = run_main(["sched", "simulate", "--trace", str(big), "--devices", "2"], capsys)
    assert_usage_error(code, err, "--drop-oversized")
    code, out, err = run_main(
        ["sched", "simulate", "--trace", str(big), "--devices", "2", "--drop-oversized", "--json"],
        capsys,
    )
    assert code == 0 and json.loads(out)["setup"]["dropped_oversized"] == 1, err
    code, _, err = run_main(["sched", "simulate", "--trace", str(big), "--devices", "0"], capsys)
    assert_usage_error(code, err, "--devices 0")


def test_durations_as_typed() -> None:
    assert [parse_duration(t, "--slice") for t in ("40m", "1h", "90s", "600", "1.5h", "2d")] == [
        2400.0,
        3600.0,
        90.0,
        600.0,
        5400.0,
        172800.0,
    ]
    assert parse_duration("0", "--restart", allow_zero=True) == 0.0


def test_sched_alone_prints_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["sched"], capsys)
    assert code == 2 and "simulate" in out + err
    assert (out + err).count("Usage:") == 1  # once, not twice


def test_the_benchmark_without_its_trace_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert benchmark.main(["--trace", str(tmp_path / "philly.csv")]) == 2
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1 and "no trace at" in out
