"""Trace-driven discrete-event simulation of a policy on a cluster, with a fake clock.

Events live on one heap: arrivals (from the trace), completions (predicted from each running
job's rate, re-predicted whenever its allocation changes; stale ones carry an old version and
are dropped) and slice boundaries (whole multiples of ``cluster.slice_s``). All events at one
instant are applied, then the policy decides once, and the simulator acts on its allocation as
an executor would: start, preempt, resize, through :func:`~.jobs.advance` (so every transition
is a legal one) and :func:`~.policy.place` (so no two jobs share a device).

[Note: simulated work] A job's work is ``duration x s(devices)`` one-device seconds: the trace
says how long it ran on the devices it asked for, and its speed-up curve ``s`` says how fast
it progresses on any other count. While it holds ``k`` devices it does ``s(k)`` one-device
seconds of work per second, except right after a resume or a resize: then it holds its
devices but does no work for ``restart_s`` (checkpoint, relaunch, restore). Pollux (OSDI'21)
and Gandiva (OSDI'18) both account for what stopping and restarting a job costs; the default,
30 s, is ours (a knob: ``--restart``), not a measured figure. A first start costs nothing
extra in any policy.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from polytrain.errors import ConfigError
from polytrain.scheduler.jobs import JobState, JobView, advance
from polytrain.scheduler.policy import Cluster, Policy, check_allocation, place
from polytrain.scheduler.report import JobRecord, Summary, summarize
from polytrain.scheduler.speedup import Curves, curve, useful_counts
from polytrain.scheduler.trace import TraceJob, fit_cluster

__all__ = ["DEFAULT_RESTART_S", "SimResult", "simulate"]

DEFAULT_RESTART_S = 30.0
_ARRIVAL, _COMPLETION, _SLICE = 0, 1, 2


@dataclass
class SimResult:
    summary: Summary
    jobs: list[JobRecord]
    placements: list[dict[str, tuple[int, ...]]] = field(default_factory=list)


class _Job:
    """The simulator's mutable record of one job; :meth:`view` is what the policy sees."""

    __slots__ = (
        "_view",
        "alloc",
        "attained",
        "done",
        "executed",
        "finished",
        "first_started",
        "last_stopped",
        "max_devices",
        "preemptions",
        "restart_until",
        "spec",
        "speedup",
        "started",
        "state",
        "version",
        "work",
    )

    def __init__(self, spec: TraceJob, max_devices: int, curves: Curves | None) -> None:
        self.spec = spec
        self.max_devices = max_devices  # the elastic ceiling (= spec.devices when not elastic)
        full = curve(spec.model, max(spec.devices, max_devices), curves)
        self.speedup = useful_counts(full, keep=spec.devices)
        self.work = spec.duration * self.speedup[spec.devices]
        self.done = 0.0
        self.state = JobState.QUEUED
        self.alloc = 0
        self.attained = 0.0
        self.started: float | None = None
        self.first_started: float | None = None
        self.finished: float | None = None
        self.last_stopped: float | None = None
        self.executed = 0.0
        self.preemptions = 0
        self.restart_until = 0.0
        self.version = 0
        self._view: JobView | None = None

    def view(self, restart_s: float) -> JobView:
        if self._view is None or self.alloc:  # a running job's service changes every instant
            spec = self.spec
            self._view = JobView(
                id=spec.id,
                submitted=spec.submitted,
                devices=spec.devices,
                state=self.state,
                allocated=self.alloc,
                min_devices=spec.min_devices,
                max_devices=self.max_devices,
                attained=self.attained,
                remaining=(self.work - self.done) / self.speedup[spec.devices],
                started=self.started,
                first_started=self.first_started,
                speedup=self.speedup,
                restart_s=restart_s,
                last_stopped=self.last_stopped,
                executed_s=self.executed,
            )
        return self._view

    def go(self, new: JobState) -> None:
        self.state = advance(self.spec.id, self.state, new)
        self._view = None


def simulate(
    trace: Sequence[TraceJob],
    policy: Policy,
    cluster: Cluster,
    *,
    restart_s: float = DEFAULT_RESTART_S,
    check: bool = True,
    keep_placements: bool = False,
    elastic: float = 1.0,
    curves: Curves | None = None,
) -> SimResult:
    """Run ``trace`` under ``policy`` until every job finishes; per-job records and a summary.

    ``check`` verifies every allocation (:func:`check_allocation`) and places it on device
    indices (:func:`place`); ``keep_placements`` keeps each placement for tests. ``elastic``
    lets an elastic policy (goodput) grow a job to ``elastic`` times its ask (at most the
    cluster), as Pollux sizes its jobs itself; the other policies run each job on its ask.
    ``curves``: each model class's speed-up by device count (:func:`~.speedup.planned_curves`);
    default the analytic classes of :mod:`.speedup`."""
    if not trace:
        raise ConfigError("no jobs to simulate: give a trace with at least one job")
    by_id = {spec.id: i for i, spec in enumerate(trace)}
    if len(by_id) < len(trace):
        again = next(spec for i, spec in enumerate(trace) if by_id[spec.id] != i)
        raise ConfigError(f"job id {again.id!r} appears twice: give every job its own id")
    fit_cluster(trace, cluster.devices)  # a job that can never run is a one-line error
    wall = time.perf_counter()
    if not elastic >= 1.0:
        raise ConfigError(f"elastic = {elastic}: give 1 (jobs run on what they ask) or more")
    ceiling = [min(cluster.devices, math.ceil(spec.devices * elastic)) for spec in trace]
    jobs = [_Job(spec, top, curves) for spec, top in zip(trace, ceiling, strict=True)]
    heap: list[tuple[float, int, int, int]] = [
        (spec.submitted, _ARRIVAL, i, 0) for i, spec in enumerate(trace)
    ]
    heapq.heapify(heap)
    active: dict[int, _Job] = {}  # by index in trace, arrival order
    running: dict[int, _Job] = {}
    held: dict[str, tuple[int, ...]] = {}
    placements: list[dict[str, tuple[int, ...]]] = []
    pending = len(trace)  # arrivals not yet seen
    now = 0.0
    busy = 0.0  # device-seconds held
    crowd = 0.0  # integral of the number of active jobs over time (finish-time fairness)
    crowd_at: dict[int, float] = {}
    crowd_total: dict[int, float] = {}
    decisions = 0
    next_slice = cluster.slice_s
    heapq.heappush(heap, (next_slice, _SLICE, -1, 0))
    while heap:
        t = heap[0][0]
        dt = t - now
        if dt > 0:
            for job in running.values():
                job.done += job.speedup[job.alloc] * max(0.0, t - max(now, job.restart_until))
                job.attained += job.alloc * dt
                job.executed += dt
                busy += job.alloc * dt
            crowd += len(active) * dt
            now = t
        while heap and heap[0][0] <= now:
            _, kind, index, version = heapq.heappop(heap)
            if kind == _ARRIVAL:
                active[index] = jobs[index]
                crowd_at[index] = crowd
                pending -= 1
            elif kind == _COMPLETION:
                job = jobs[index]
                if version == job.version and job.alloc:
                    job.done = job.work
                    job.finished = now
                    job.go(JobState.FINISHED)
                    job.alloc = 0
                    del running[index], active[index]
                    held.pop(job.spec.id, None)
                    crowd_total[index] = crowd - crowd_at[index]
            elif active or pending:
                # the next boundary; over an idle stretch, the first one after the next arrival
                upcoming = now if active else max(now, _next_arrival(heap))
                next_slice = (math.floor(upcoming / cluster.slice_s) + 1) * cluster.slice_s
                heapq.heappush(heap, (next_slice, _SLICE, -1, 0))
        if not active:
            continue
        views = [job.view(restart_s) for job in active.values()]
        allocation = policy.decide(views, cluster, now)
        decisions += 1
        if check:
            check_allocation(allocation, views, cluster)
        for index in {*running, *(by_id[k] for k, v in allocation.items() if v)}:
            job = jobs[index]
            if _apply(job, allocation.get(job.spec.id, 0), now, restart_s):
                if job.alloc:
                    running[index] = job
                    job.version += 1
                    start = max(now, job.restart_until)
                    finish = start + (job.work - job.done) / job.speedup[job.alloc]
                    heapq.heappush(heap, (finish, _COMPLETION, index, job.version))
                else:
                    del running[index]
        if check:
            ids = {job.spec.id: job.alloc for job in running.values()}
            held = place(ids, {k: v for k, v in held.items() if k in ids}, cluster.devices)
            if keep_placements:
                placements.append(dict(held))
    records = [_record(job, crowd_total[i], cluster.devices) for i, job in enumerate(jobs)]
    summary = summarize(
        policy.name,
        records,
        devices=cluster.devices,
        busy_device_s=busy,
        decisions=decisions,
        wall_s=time.perf_counter() - wall,
    )
    return SimResult(summary, records, placements)


def _next_arrival(heap: list[tuple[float, int, int, int]]) -> float:
    return min((t for t, kind, _, _ in heap if kind == _ARRIVAL), default=0.0)


def _apply(job: _Job, new: int, now: float, restart_s: float) -> bool:
    """Act on one job's new device count as an executor would; True if it changed."""
    old = job.alloc
    if new == old:
        return False
    if old:  # stop it: preemption, or the first half of a resize
        assert job.started is not None
        job.go(JobState.PREEMPTING)
        job.go(JobState.SUSPENDED)
        job.preemptions += 1
        job.last_stopped = now
        job.started = None
    job.alloc = new
    if new:
        job.go(JobState.RUNNING)
        job.restart_until = now + restart_s if job.last_stopped is not None else now
        job.started = now
        if job.first_started is None:
            job.first_started = now
    return True


def _record(job: _Job, crowd: float, devices: int) -> JobRecord:
    spec = job.spec
    assert job.finished is not None and job.first_started is not None
    jct = job.finished - spec.submitted
    # Themis's finish-time fairness: JCT shared / JCT alone on a 1/N share of the cluster,
    # N the average number of active jobs over the job's life (see docs/scheduler.md).
    contenders = max(1.0, crowd / jct) if jct > 0 else 1.0
    share = devices / contenders
    isolated = spec.duration * max(1.0, spec.devices / share)
    return JobRecord(
        id=spec.id,
        submitted=spec.submitted,
        devices=spec.devices,
        model=spec.model,
        first_started=job.first_started,
        finished=job.finished,
        jct=jct,
        queueing=job.first_started - spec.submitted,
        preemptions=job.preemptions,
        rho=jct / isolated,
    )
