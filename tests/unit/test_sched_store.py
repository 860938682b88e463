"""The scheduler's SQLite store: jobs and transitions persist, and only legal ones are written."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from polytrain.errors import ConfigError
from polytrain.scheduler.jobs import JobState
from polytrain.scheduler.store import DB_NAME, JobRecord, Store


def record(job_id: str, submitted: float = 0.0) -> JobRecord:
    return JobRecord(
        id=job_id,
        config=f"/jobs/{job_id}.toml",
        workdir="/work",
        devices=2,
        min_devices=1,
        steps=40,
        checkpoint_every=10,
        state=JobState.QUEUED,
        submitted=submitted,
    )


def test_state_dir_and_database_are_private_to_their_owner(tmp_path: Path) -> None:
    Store(tmp_path / "state", create=True).close()
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "state" / DB_NAME).stat().st_mode) == 0o600


def test_a_missing_state_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sched serve --state") as exc:
        Store(tmp_path / "nowhere")
    assert "\n" not in str(exc.value)


def test_jobs_and_transitions_survive_reopening(tmp_path: Path) -> None:
    store = Store(tmp_path, create=True)
    store.add(record("a", 1.0))
    store.add(record("b", 2.0))
    store.transition("a", JobState.RUNNING, allocated=2, placed=(0, 1), started=5.0, now=5.0)
    store.transition("a", JobState.PREEMPTING, preempt_at=9.0, preempt_step=10, now=9.0)
    store.close()
    again = Store(tmp_path)
    a = again.get("a")
    assert (a.state, a.allocated, a.placed, a.preempt_step) == (JobState.PREEMPTING, 2, (0, 1), 10)
    assert [j.id for j in again.jobs()] == ["a", "b"]
    history = [(e["old"], e["new"]) for e in again.events("a")]
    assert history == [(None, "queued"), ("queued", "running"), ("running", "preempting")]


def test_an_illegal_transition_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    store = Store(tmp_path, create=True)
    store.add(record("a"))
    with pytest.raises(ConfigError, match="cannot go from queued to suspended"):
        store.transition("a", JobState.SUSPENDED, allocated=3)
    a = store.get("a")
    assert (a.state, a.allocated) == (JobState.QUEUED, 0)
    assert len(store.events("a")) == 1
    store.transition("a", JobState.CANCELLED)
    with pytest.raises(ConfigError, match="none \\(it is done\\)"):
        store.transition("a", JobState.RUNNING)


def test_a_transition_from_a_stale_view_is_refused(tmp_path: Path) -> None:
    """A cancel that lands between the serve loop's read and its start: the start fails."""
    store = Store(tmp_path, create=True)
    store.add(record("a"))
    Store(tmp_path).transition("a", JobState.CANCELLED)  # another process
    with pytest.raises(ConfigError, match="is cancelled now"):
        store.transition("a", JobState.RUNNING, expect=(JobState.QUEUED, JobState.SUSPENDED))


def test_a_duplicate_id_leaves_the_queue_as_it_was(tmp_path: Path) -> None:
    store = Store(tmp_path, create=True)
    store.add(record("a", 1.0))
    with pytest.raises(ConfigError, match="'a' is already in the queue"):
        store.add(record("a", 2.0))
    assert [(j.id, j.submitted) for j in store.jobs()] == [("a", 1.0)]


def test_states_change_only_through_transition(tmp_path: Path) -> None:
    store = Store(tmp_path, create=True)
    store.add(record("a"))
    with pytest.raises(AssertionError):
        store.update("a", state=JobState.FINISHED)
    assert store.update("a", cancel_requested=True).cancel_requested


def test_cluster_is_what_serve_last_set(tmp_path: Path) -> None:
    store = Store(tmp_path, create=True)
    with pytest.raises(ConfigError, match="no cluster yet"):
        store.cluster()
    store.set_cluster(4, "cpu")
    store.set_cluster(2, "cuda")
    assert store.cluster() == (2, "cuda")
