"""`MetricsWriter` hands records to trackers and closes them; what a tracker receives
(docs/observability.md). The trackers themselves: tests/integration/test_trackers.py."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from polytrain.observe.metrics import MetricsWriter
from polytrain.observe.trackers import flatten, scalars


class Recorder:
    def __init__(self, fail_close: bool = False) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed: list[bool] = []  # the ``failed`` of each close
        self.fail_close = fail_close

    def log(self, record: Mapping[str, float], step: int) -> None:
        self.logged.append((step, dict(record)))

    def close(self, *, failed: bool = False) -> None:
        self.closed.append(failed)
        if self.fail_close:
            raise OSError("store unreachable")


RECORD = {"step": 10, "loss": 2.5, "lr": 1e-3, "strategy": "ddp-dp2", "skipped": True, "n": 3}


def test_a_tracker_gets_each_records_numeric_fields_at_its_step(tmp_path: Path) -> None:
    tracker = Recorder()
    with MetricsWriter(tmp_path / "metrics.jsonl", [tracker]) as metrics:
        metrics.write(RECORD)
    assert tracker.logged == [(10, {"loss": 2.5, "lr": 1e-3, "n": 3.0})]
    assert tracker.closed == [False]
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == RECORD


def test_scalars_and_flat_parameters() -> None:
    assert scalars(RECORD) == {"loss": 2.5, "lr": 1e-3, "n": 3.0}
    job = {"optim": {"lr": 0.1}, "model": {"args": {}, "name": "gpt"}, "strategy": "manual"}
    assert flatten(job) == {
        "optim.lr": 0.1,
        "model.args": {},
        "model.name": "gpt",
        "strategy": "manual",
    }


def test_trackers_close_as_failed_and_the_trainings_error_is_the_one_raised(
    tmp_path: Path,
) -> None:
    broken, other = Recorder(fail_close=True), Recorder()
    with pytest.raises(RuntimeError, match="step failed"):
        with MetricsWriter(tmp_path / "metrics.jsonl", [broken, other]) as metrics:
            metrics.write(RECORD)
            raise RuntimeError("step failed")
    assert (broken.closed, other.closed) == ([True], [True])


def test_every_tracker_is_closed_before_a_close_error_is_raised(tmp_path: Path) -> None:
    broken, other = Recorder(fail_close=True), Recorder()
    with pytest.raises(OSError, match="store unreachable"):
        with MetricsWriter(None, [broken, other]):
            pass
    assert (broken.closed, other.closed) == ([False], [False])
