"""``polytrain plan``: JSON for tools, PAI's question end to end, one-line errors (exit 2)."""

from __future__ import annotations

import json
import shlex
from datetime import datetime, timezone

import pytest
import tomllib

from polytrain.cli.plan import parse_deadline, parse_devices
from polytrain.errors import PlanError
from tests.helpers.cli import run_main

_run = run_main


def test_plan_json_answers_pais_question(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "gpt", "--size", "medium", "--budget", "20", "--deadline", "2h"]
    code, out, _ = _run([*argv, "--cluster", "4x8xH100:ib400", "--json", "--top", "3"], capsys)
    assert code == 0
    data = json.loads(out)
    best = data["best"]
    assert data["objective"] == "cost"  # a deadline: the cheapest that finishes in time
    assert best["meets"] and best["cost_usd"] <= 20 and best["total_s"] <= 7200
    assert best["overrides"]["launch.nproc"] == best["devices"]
    assert len(data["plans"]) == 3 and all(p["why"] for p in data["plans"][1:])


def test_plan_table_and_nothing_meets_the_budget(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        [
            "plan",
            "--model",
            "gpt",
            "--size",
            "medium",
            "--budget",
            "0.001",
            "--cluster",
            "1x8xA100-40GB",
        ],
        capsys,
    )
    assert code == 0
    assert "no layout meets a budget of $0.00" in out
    assert "cheapest and fastest" in out


def test_plan_for_a_model_that_fits_no_device(capsys: pytest.CaptureFixture[str]) -> None:
    # 8 layers of GPT-3 175B (14.5 B parameters, ~230 GB of model states with Adam)
    big = ["--set", "model.n_layer=8", "--set", "model.n_embd=12288", "--set", "model.n_head=96"]
    code, out, _ = _run(["plan", "--model", "gpt", *big, "--cluster", "1x2xL4", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["best"] is None and "would fit" in data["note"]
    assert data["plans"] and all(p["step_s"] is None for p in data["plans"])  # untimed


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--cluster", "4x8xH1000:ib400"], "unknown device 'H1000'"),
        (["--cluster", "4x8"], "malformed cluster spec"),
        (["--deadline", "2020-01-01T00:00"], "is in the past"),
        (["--deadline", "0h"], "is not positive"),
        (["--deadline", "soon"], "expected a duration"),
        (["--budget", "-5"], "--budget -5.0"),
        (["--devices", "8:2"], "--devices '8:2'"),
        (["--objective", "speed"], "--objective 'speed'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(["plan", *args], capsys)
    assert code == 2
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_deadline_and_devices_parsing() -> None:
    now = datetime(2026, 11, 23, 12, 0, tzinfo=timezone.utc)
    assert parse_deadline("90m") == 5400
    assert parse_deadline("1.5h") == 5400
    assert parse_deadline("2026-11-23T13:00", now=now) == 3600
    with pytest.raises(PlanError):
        parse_deadline("2026-11-23T11:00", now=now)
    assert parse_devices("8") == (8, 8)
    assert parse_devices("2:16") == (2, 16)
    assert parse_devices(None) == (1, 0)


@pytest.mark.parametrize("cluster", ["4x8xH100:ib400", "2x8xH100:ib400"])
def test_plan_prints_the_command_that_runs_its_choice(
    cluster: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--model", "gpt", "--size", "medium", "--cluster", cluster, "--json"]
    if cluster.startswith("2x"):
        argv += ["--devices", "16"]  # two hosts: a multi-node layout
    code, out, _ = _run(argv, capsys)
    assert code == 0
    data = json.loads(out)
    assert "uncalibrated" in data["figures"] and data["validation"] == []
    words = shlex.split(data["command"])
    assert words[:2] == ["polytrain", "train"]
    # The user fills in the rendezvous of a multi-node layout; the rest runs as printed.
    filled = [{"HOST:PORT": "10.0.0.1:29500", "I": "0"}.get(w, w) for w in words[2:]]
    code, out, err = _run(["train", *filled, "--device", "cpu", "--dry-run"], capsys)
    assert code == 0, err
    job = tomllib.loads(out)
    for path, value in data["best"]["overrides"].items():
        section, key = path.split(".")
        assert job[section][key] == value, path


def test_plan_prices_a_layout_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "gpt", "--size", "medium", "--as-written", "--json"]
    sets = ["--set", "parallel.tp=2", "--set", "parallel.pp=2", "--set", "launch.nproc=8"]
    sets += ["--set", "pipeline.microbatches=4"]
    code, out, _ = _run([*base, "--cluster", "1x8xH100", *sets], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["layout"] == "dp2-tp2-pp2-1f1b-m4" and data["devices"] == 8
    assert data["step_s"] > 0 and data["memory_per_rank"] > 0 and data["fits"]
    code, _, err = _run([*base, "--cluster", "1x4xH100", *sets], capsys)
    assert code == 2 and "needs 8 devices" in err and len(err.strip().splitlines()) == 1


def test_plan_prices_a_given_layout_with_its_parts(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "gpt", "--size", "medium", "--cluster", "1x8xH100"]
    layout = "dp=2,tp=2,pp=2,micro=4,recompute=every:2"
    code, out, _ = _run([*base, "--layout", layout, "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["layout"] == "dp2-tp2-pp2-1f1b-m4-recompute-every2" and data["devices"] == 8
    parts = data["breakdown"]
    kinds = ("weights", "grads", "optimizer", "activations", "buffers")
    assert all(parts["memory_" + kind] > 0 for kind in kinds)
    assert parts["memory_total"] == data["memory_per_rank"]
    # the same layout through --as-written and --set prices the same
    sets = ["--set", "parallel.dp=2", "--set", "parallel.tp=2", "--set", "parallel.pp=2"]
    sets += ["--set", "pipeline.microbatches=4", "--set", "parallel.recompute=every:2"]
    sets += ["--set", "launch.nproc=8"]
    _, out, _ = _run([*base, "--as-written", "--json", *sets], capsys)
    assert json.loads(out)["step_s"] == data["step_s"]
    code, out, _ = _run([*base, "--layout", "dp=4,zero=3"], capsys)
    assert code == 0 and "dp4-zero3 on 4 x H100" in out
    assert "data-parallel synchronization, exposed" in out and "memory: optimizer" in out


def test_plan_prices_selective_recomputation(capsys: pytest.CaptureFixture[str]) -> None:
    # "ops" keeps each block's matmul and attention outputs: between no recomputation and
    # full recomputation in memory, and its backward reruns less than a whole forward
    base = ["plan", "--model", "gpt", "--size", "medium", "--cluster", "1x8xH100", "--json"]
    priced = {}
    for recompute in ("false", "ops", "full"):
        code, out, _ = _run([*base, "--layout", f"dp=2,recompute={recompute}"], capsys)
        assert code == 0
        priced[recompute] = json.loads(out)
    assert priced["ops"]["layout"] == "dp2-recompute-ops"
    memory = {k: v["breakdown"]["memory_activations"] for k, v in priced.items()}
    assert memory["full"] < memory["ops"] < memory["false"]
    steps = {k: v["step_s"] for k, v in priced.items()}
    assert steps["false"] < steps["ops"] < steps["full"]
    code, out, _ = _run([*base[:-1], "--layout", "dp=2,recompute=selective"], capsys)
    assert code == 0 and "dp2-recompute-ops on 2 x H100" in out and "memory: activations" in out


@pytest.mark.parametrize(
    ("layout", "named"),
    [("dp=2,foo=3", "'foo=3'"), ("dp=two", "dp=two"), ("dp", "'dp'"), ("dp=0", "dp=0")],
)
def test_a_bad_layout_is_one_line(
    layout: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(["plan", "--layout", layout], capsys)
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1


def test_plan_prices_the_new_pipeline_schedules_when_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--model", "gpt", "--size", "medium", "--cluster", "1x8xA100-40GB"]
    argv += ["--devices", "8", "--json", "--top", "60"]
    _, out, _ = _run(argv, capsys)
    assert not any("zb" in p["layout"] for p in json.loads(out)["plans"])
    _, out, _ = _run([*argv, "--new-schedules"], capsys)
    assert any("zb-h1" in p["layout"] for p in json.loads(out)["plans"])
