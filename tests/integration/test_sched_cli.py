"""``polytrain sched`` commands in-process: bad input is one line, exit 2, and the queue intact.

No job runs here (no serve loop): the state directory is made as ``serve`` makes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from polytrain.cli.sched_local import _lock
from polytrain.scheduler.jobs import JobState
from polytrain.scheduler.store import Store
from tests.helpers.cli import assert_usage_error, run_main

GOOD = """
[model]
name = "gpt"
size = "tiny"
[launch]
nproc = 2
[train]
steps = 40
global_batch_size = 8
"""  # [train] last: a case appends a key to it


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    store = Store(tmp_path / "state", create=True)
    store.set_cluster(2, "cpu")
    store.close()
    return tmp_path / "state"


def job_file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def queued(state: Path, capsys: pytest.CaptureFixture[str]) -> list[tuple[str, str]]:
    code, out, err = run_main(["sched", "status", "--state", str(state), "--json"], capsys)
    assert code == 0, err
    return [(j["id"], j["state"]) for j in json.loads(out)["jobs"]]


def test_bad_submissions_are_one_line_and_leave_the_queue_intact(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = job_file(tmp_path, "good", GOOD + '[checkpoint]\ndir = "mine"\n')
    code, out, err = run_main(["sched", "submit", str(good), "--state", str(state)], capsys)
    assert code == 0, err
    assert "queued 'good': 2 device(s)" in out and "a checkpoint every 2" in out
    assert "not used: checkpoint.dir = 'mine'" in out  # the scheduler owns it, and says so
    stored = state / "jobs" / "good" / "job.toml"
    assert stored.read_text() == good.read_text()

    cases = [
        (["--name", "good"], good, "job id 'good' is already in the queue"),
        (["--name", "big", "--devices", "3"], good, "asks for 3 devices and the cluster has 2"),
        (["--name", "neg"], job_file(tmp_path, "neg", GOOD + "seed = -5\n"), "train.seed"),
        (["--name", "tp"], job_file(tmp_path, "tp", GOOD + "[parallel]\ntp = 3\n"), "tp"),
        (["--name", "typo"], job_file(tmp_path, "typo", GOOD + "stepz = 5\n"), "stepz"),
        (["--name", "bad/id"], good, "job id 'bad/id'"),
        (["--name", "m", "--min-devices", "3"], good, "--min-devices 3 with --devices 2"),
        (["--name", "gone"], tmp_path / "missing.toml", "does not exist"),
    ]
    for flags, path, expected in cases:
        code, _, err = run_main(
            ["sched", "submit", str(path), "--state", str(state), *flags], capsys
        )
        assert_usage_error(code, err, expected)
    assert queued(state, capsys) == [("good", "queued")]
    assert sorted(p.name for p in (state / "jobs").iterdir()) == ["good"]


def test_a_one_device_minimum_is_validated_too(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job may be resized down to --min-devices: the layout must hold there as well."""
    pp2 = job_file(tmp_path, "pp2", GOOD + "[parallel]\npp = 2\n")
    code, _, err = run_main(
        ["sched", "submit", str(pp2), "--state", str(state), "--min-devices", "1"], capsys
    )
    assert_usage_error(code, err, "pp")
    assert queued(state, capsys) == []


def test_cancel_status_and_logs(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = job_file(tmp_path, "good", GOOD)
    assert run_main(["sched", "submit", str(good), "--state", str(state)], capsys)[0] == 0
    code, out, _ = run_main(["sched", "cancel", "good", "--state", str(state)], capsys)
    assert code == 0 and "cancelled 'good'" in out
    code, _, err = run_main(["sched", "cancel", "good", "--state", str(state)], capsys)
    assert_usage_error(code, err, "already cancelled")
    code, _, err = run_main(["sched", "logs", "nobody", "--state", str(state)], capsys)
    assert_usage_error(code, err, "no job 'nobody'")
    code, out, _ = run_main(["sched", "status", "--state", str(state)], capsys)
    assert code == 0 and "cancelled" in out.splitlines()[1]


def test_serve_refuses_bad_flags_and_a_second_server(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["sched", "serve", "--state", str(state), "--devices", "2"]
    code, _, err = run_main([*base, "--slice", "soon"], capsys)
    assert_usage_error(code, err, "--slice 'soon'")
    code, _, err = run_main([*base, "--policy", "lottery"], capsys)
    assert_usage_error(code, err, "lottery")  # the policy package's own words
    held = _lock(Store(state))  # as a running serve holds it
    try:
        code, _, err = run_main(base, capsys)
        assert_usage_error(code, err, f"another `polytrain sched serve` (pid {os.getpid()})")
    finally:
        os.close(held)


def test_submit_needs_a_served_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = job_file(tmp_path, "good", GOOD)
    code, _, err = run_main(["sched", "submit", str(good), "--state", str(tmp_path / "s")], capsys)
    assert_usage_error(code, err, "polytrain sched serve --state")


def test_logs_prints_every_start_in_order(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = job_file(tmp_path, "good", GOOD)
    assert run_main(["sched", "submit", str(good), "--state", str(state)], capsys)[0] == 0
    store = Store(state)
    store.transition("good", JobState.RUNNING, starts=2)  # as the serve loop records starts
    for start in (1, 2):
        (state / "jobs" / "good" / f"start-{start}.log").write_text(f"output of start {start}\n")
    code, out, _ = run_main(["sched", "logs", "good", "--state", str(state)], capsys)
    assert code == 0 and out == "output of start 1\noutput of start 2\n"


def test_serve_refuses_fewer_devices_than_its_jobs_hold(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = job_file(tmp_path, "good", GOOD)
    assert run_main(["sched", "submit", str(good), "--state", str(state)], capsys)[0] == 0
    Store(state).transition("good", JobState.RUNNING, allocated=2, placed=(0, 1), starts=1)
    code, _, err = run_main(["sched", "serve", "--state", str(state), "--devices", "1"], capsys)
    assert_usage_error(code, err, "job 'good' needs 2 devices and --devices is 1")
    Store(state).update("good", min_devices=1)
    code, _, err = run_main(["sched", "serve", "--state", str(state), "--devices", "1"], capsys)
    assert_usage_error(code, err, "job 'good' still runs on device 1 and --devices is 1")
    assert Store(state).cluster() == (2, "cpu")


def test_an_elastic_job_carries_the_planners_speedup(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--max-devices` lets goodput grow a data-parallel job; the planner prices each count."""
    job = job_file(tmp_path, "elastic", GOOD)
    code, _, err = run_main(
        [
            "sched",
            "submit",
            str(job),
            "--state",
            str(state),
            "--devices",
            "1",
            "--max-devices",
            "2",
        ],
        capsys,
    )
    assert code == 0, err
    record = Store(state).get("elastic")
    assert record.max_devices == 2 and record.speedup[1] == pytest.approx(1.0)
    assert record.speedup[2] > 1.0  # two replicas of the global batch: faster on the planner's host
    code, _, err = run_main(
        ["sched", "submit", str(job), "--state", str(state), "--name", "x", "--max-devices", "3"],
        capsys,
    )
    assert_usage_error(code, err, "--max-devices 3")
