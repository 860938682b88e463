"""The executor's control loop against a fake backend, a fake clock and fake checkpoints.

What is checked: a preempted job is stopped only once a checkpoint newer than the request has
landed, and only then are its devices given to another job; a resize resumes on the new count;
a restart adopts live jobs and suspends vanished ones; cancel; and, over a long random run,
that no device ever holds two jobs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from polytrain.scheduler.backend import Launch
from polytrain.scheduler.executor import Executor, request_cancel
from polytrain.scheduler.jobs import JobState, JobView
from polytrain.scheduler.policy import Allocation, Cluster, Policy
from polytrain.scheduler.store import JobRecord, Store


class FakeBackend:
    """Records starts and stops; refuses to start a job on a device another job holds."""

    name = "fake"

    def __init__(self) -> None:
        self.running: dict[str, Launch] = {}
        self.launches: list[Launch] = []
        self.stops: list[str] = []
        self.exits: dict[str, int] = {}  # to report at the next poll
        self.alive: set[str] = set()  # what adopt finds

    def start(self, launch: Launch) -> None:
        busy = {d for other in self.running.values() for d in other.devices}
        assert not busy & set(launch.devices), f"{launch.job_id} on busy devices {launch.devices}"
        assert launch.job_id not in self.running
        self.running[launch.job_id] = launch
        self.launches.append(launch)

    def stop(self, job_id: str) -> None:
        self.stops.append(job_id)
        self.running.pop(job_id, None)

    def poll(self) -> dict[str, int]:
        out, self.exits = self.exits, {}
        for job_id in out:
            self.running.pop(job_id, None)
        return out

    def adopt(self, launch: Launch) -> bool:
        if launch.job_id in self.alive:
            self.running[launch.job_id] = launch
            return True
        return False

    def finish(self, job_id: str, code: int = 0) -> None:
        self.exits[job_id] = code


class Scripted:
    """Allocations from a table of (from time, {job: devices}); active jobs only."""

    name = "scripted"

    def __init__(self, script: Sequence[tuple[float, dict[str, int]]]) -> None:
        self.script = script

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation:
        table = [alloc for start, alloc in self.script if start <= now][-1]
        active = {j.id for j in jobs if j.active}
        return {k: v for k, v in table.items() if k in active}


class Fifo:
    """Whole jobs in submission order, none preempted (test-local: the policy package's own
    fifo may differ in what it backfills)."""

    name = "fifo"

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation:
        out = {j.id: j.allocated for j in jobs if j.state == JobState.RUNNING}
        free = cluster.devices - sum(out.values())
        for job in sorted(jobs, key=lambda j: (j.submitted, j.id)):
            if job.active and job.id not in out and job.devices <= free:
                out[job.id] = job.devices
                free -= job.devices
        return out


class LeastServed:
    """Time slicing: a running job keeps its devices for a slice since it started, then every
    job competes again, least attained service first."""

    name = "least-served"

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation:
        out = {
            j.id: j.allocated
            for j in jobs
            if j.state == JobState.RUNNING and now - (j.started or 0.0) < cluster.slice_s
        }
        free = cluster.devices - sum(out.values())
        for job in sorted(jobs, key=lambda j: (j.attained, j.submitted, j.id)):
            if job.active and job.id not in out and job.devices <= free:
                out[job.id] = job.devices
                free -= job.devices
        return out


class World:
    """A store, a fake backend, a clock and each job's newest checkpoint step."""

    def __init__(self, tmp_path: Path, policy: Policy, devices: int = 2, slice_s: float = 10.0):
        self.store = Store(tmp_path, create=True)
        self.backend = FakeBackend()
        self.now = 0.0
        self.ckpt: dict[str, int] = {}
        self.cluster = Cluster(devices, slice_s)
        self.policy = policy
        self.executor = self.fresh_executor()

    def fresh_executor(self) -> Executor:
        return Executor(
            self.store,
            self.backend,
            self.policy,
            self.cluster,
            clock=lambda: self.now,
            checkpoints=lambda path: self.ckpt.get(path.parent.name),
        )

    def submit(self, job_id: str, devices: int, min_devices: int = 1, steps: int = 100) -> None:
        self.store.add(
            JobRecord(
                id=job_id,
                config=f"/jobs/{job_id}.toml",
                workdir="/work",
                devices=devices,
                min_devices=min_devices,
                steps=steps,
                checkpoint_every=10,
                state=JobState.QUEUED,
                submitted=self.now,
            )
        )

    def at(self, now: float) -> None:
        self.now = now
        self.executor.tick()

    def state(self, job_id: str) -> JobState:
        return self.store.get(job_id).state


def test_preemption_waits_for_a_checkpoint_newer_than_the_request(tmp_path: Path) -> None:
    w = World(tmp_path, Scripted([(0, {"a": 2, "b": 0}), (10, {"a": 0, "b": 2})]))
    w.submit("a", 2)
    w.submit("b", 2)
    w.at(0)
    assert w.state("a") == JobState.RUNNING and w.backend.running["a"].devices == (0, 1)
    w.ckpt["a"] = 10
    w.at(10)  # slice boundary: the policy hands the devices to b
    assert w.state("a") == JobState.PREEMPTING and w.store.get("a").preempt_step == 10
    for t in (11, 12, 13):  # the step-10 checkpoint is older than the request: keep running
        w.at(t)
        assert w.backend.stops == [] and w.state("b") == JobState.QUEUED
    w.ckpt["a"] = 20
    w.at(14)
    assert w.backend.stops == ["a"] and w.state("a") == JobState.SUSPENDED
    assert w.state("b") == JobState.RUNNING and w.backend.running["b"].devices == (0, 1)
    history = [e["new"] for e in w.store.events("a")]
    assert history == ["queued", "running", "preempting", "suspended"]


def test_a_job_at_its_last_checkpoint_is_left_to_finish(tmp_path: Path) -> None:
    w = World(tmp_path, Scripted([(0, {"a": 2}), (10, {"a": 0})]))
    w.submit("a", 2, steps=30)
    w.at(0)
    w.at(10)
    w.ckpt["a"] = 30  # its final checkpoint: the trainer would refuse to resume it
    w.at(11)
    assert w.backend.stops == [] and w.state("a") == JobState.PREEMPTING
    w.backend.finish("a")
    w.at(12)
    assert w.state("a") == JobState.FINISHED and w.store.get("a").exit_code == 0


def test_a_resize_resumes_from_the_checkpoint_on_the_new_count(tmp_path: Path) -> None:
    w = World(tmp_path, Scripted([(0, {"a": 2}), (10, {"a": 1, "b": 1})]))
    w.submit("a", 2, min_devices=1)
    w.submit("b", 1)
    w.at(0)
    w.at(10)
    w.ckpt["a"] = 30
    w.at(11)
    first, second = [launch for launch in w.backend.launches if launch.job_id == "a"]
    assert (len(first.devices), first.resume, first.run_dir.name) == (2, False, "start-1")
    assert (len(second.devices), second.resume, second.run_dir.name) == (1, True, "start-2")
    assert first.checkpoint_dir == second.checkpoint_dir
    assert w.state("b") == JobState.RUNNING
    assert set(w.backend.running["a"].devices) | set(w.backend.running["b"].devices) == {0, 1}
    # Service is device-seconds: 2 devices for the 11 s until the stop.
    assert w.store.get("a").attained == pytest.approx(22.0)


def test_a_failed_job_frees_its_devices_for_the_next(tmp_path: Path) -> None:
    w = World(tmp_path, Fifo())
    w.submit("a", 2)
    w.submit("b", 2)
    w.at(0)
    assert w.state("b") == JobState.QUEUED  # no room
    w.backend.finish("a", 1)
    w.at(1)
    a = w.store.get("a")
    assert (a.state, a.exit_code) == (JobState.FAILED, 1) and "sched logs a" in a.message
    assert w.state("b") == JobState.RUNNING


def test_restart_adopts_live_jobs_and_suspends_vanished_ones(tmp_path: Path) -> None:
    w = World(tmp_path, Scripted([(0, {"a": 1, "b": 1})]))
    w.submit("a", 1)
    w.submit("b", 1)
    w.at(0)
    w.ckpt["b"] = 20
    # The scheduler dies; a's processes live on, b's are gone. A new executor takes over.
    w.backend = FakeBackend()
    w.backend.alive = {"a"}
    w.executor = w.fresh_executor()
    w.now = 5
    w.executor.recover()
    assert w.state("a") == JobState.RUNNING and w.backend.launches == []
    b = w.store.get("b")
    assert (b.state, b.allocated, b.placed) == (JobState.SUSPENDED, 0, ())
    assert "gone when the scheduler restarted" in w.store.events("b")[-1]["note"]
    w.at(6)  # b resumes from its checkpoint on a free device, a keeps its own
    (launch,) = w.backend.launches
    assert (launch.job_id, launch.resume, launch.run_dir.name) == ("b", True, "start-2")
    assert launch.devices != w.store.get("a").placed
    w.backend.finish("a")
    w.at(7)
    assert w.state("a") == JobState.FINISHED


def test_cancel_queued_at_once_and_running_through_the_loop(tmp_path: Path) -> None:
    w = World(tmp_path, Fifo())
    w.submit("a", 2)
    w.submit("b", 2)
    w.at(0)
    assert request_cancel(w.store, "b").state == JobState.CANCELLED
    assert request_cancel(w.store, "a").state == JobState.RUNNING  # asked, not yet done
    w.at(1)
    assert w.backend.stops == ["a"] and w.state("a") == JobState.CANCELLED


def test_no_two_jobs_ever_share_a_device(tmp_path: Path) -> None:
    """Gandiva-style slicing over 5 jobs on 4 devices for 400 ticks, with checkpoints landing
    and jobs ending at random: the fake backend asserts on every start."""
    rng = random.Random(0)
    w = World(tmp_path, LeastServed(), devices=4, slice_s=5.0)
    for i in range(5):
        w.submit(f"j{i}", rng.choice([1, 2, 4]), steps=10_000)
    for tick in range(400):
        for job_id in list(w.backend.running):
            w.ckpt[job_id] = w.ckpt.get(job_id, 0) + rng.choice([0, 0, 10])
            if rng.random() < 0.01:
                w.backend.finish(job_id)
        w.at(float(tick))
        held = [d for launch in w.backend.running.values() for d in launch.devices]
        assert len(held) == len(set(held)), held
        placed = [d for job in w.store.jobs() for d in job.placed]
        assert sorted(placed) == sorted(held)
    states = {w.state(f"j{i}") for i in range(5)}
    assert JobState.FINISHED in states
    assert len({launch.job_id for launch in w.backend.launches}) == 5
    assert any(e["new"] == "suspended" for i in range(5) for e in w.store.events(f"j{i}"))


class Recording(Scripted):
    """Scripted, and keeps the views it was last asked about."""

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation:
        self.views = {j.id: j for j in jobs}
        return super().decide(jobs, cluster, now)


def test_the_policy_sees_service_and_remaining_work(tmp_path: Path) -> None:
    """attained = devices x seconds held; remaining = steps after the newest checkpoint x the
    last logged step time, scaled from the devices it was measured on to the job's full count."""
    policy = Recording([(0, {"a": 1}), (10, {"a": 0, "b": 1})])
    w = World(tmp_path, policy)
    w.submit("a", 2, steps=100)
    w.submit("b", 1)
    w.at(0)
    run = tmp_path / "jobs" / "a" / "start-1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 40, "step_time_s": 0.5}\n{"step": 50, "st')
    w.ckpt["a"] = 40
    w.at(10)  # boundary: asked with a on 1 device for 10 s
    a = policy.views["a"]
    assert (a.attained, a.remaining, a.started) == (10.0, 60 * 0.5 * 1 / 2, 0.0)
    w.ckpt["a"] = 50
    w.at(12)  # stopped and suspended: its estimate stays, its service stops growing
    a = policy.views["a"]
    assert (a.state, a.attained, a.remaining, a.started) == (
        JobState.SUSPENDED,
        12.0,
        50 * 0.5 * 1 / 2,
        None,
    )
