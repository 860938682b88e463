"""Elastic allocation by marginal speed-up, Pollux-like.

Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep Learning",
OSDI 2021. Pollux re-allocates devices so that the jobs' summed speed-up (throughput
relative to a fair share) is highest, and charges each re-allocation its restart cost. This
policy keeps that idea with three simple, documented steps instead of Pollux's genetic search
and its learned goodput model (the speed-up curves are given: ``JobView.speedup``):

1. **Admission** in discretised 2D-LAS order (:func:`~.tiresias.las_priority`, Tiresias's
   queues and starvation promotion), so no job starves: each admitted job gets its
   ``min_devices``; a job that does not fit is skipped.
2. **Keep**: a running admitted job is first given back what it holds (while devices last), so
   that nothing is restarted for no gain.
3. **Grow**: the remaining devices go one step at a time to the admitted job whose next
   runnable device count adds the most speed-up per added device (a heap), up to its
   ``ceiling`` (its ask, or ``max_devices`` for a job that lets the scheduler grow it past the
   ask, as Pollux's jobs do: ``simulate(..., elastic=F)``). A running job's first step
   beyond what it holds is priced with its restart ([Note: restart horizon]).

[Note: restart horizon] Growing a running job from ``c`` to ``t`` devices costs it
``restart_s`` of no progress; it pays if, over the horizon ``h`` the new count will hold, the
job does more work: ``s(t) (h - restart_s) > s(c) h``. The horizon is the next slice, or the
time the job needs to finish at ``c`` where that is shorter (``JobView.remaining``): a job
about to finish is not restarted for a speed-up it has no time left to use.

A running job shrinks only when admission needs its devices (step 1 outranks step 2). Jobs
without a speed-up curve run only at their requested ``devices``. Decisions happen at events
and slice boundaries only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from polytrain.scheduler.jobs import JobState, JobView
from polytrain.scheduler.policies.tiresias import Tiresias, las_priority
from polytrain.scheduler.policy import Allocation, Cluster

__all__ = ["Goodput", "runnable_counts"]


def runnable_counts(job: JobView) -> list[int]:
    """Device counts the job may run on, ascending: its curve's counts in min..max."""
    if not job.speedup:
        return [job.devices]
    return sorted(k for k in job.speedup if job.min_devices <= k <= job.ceiling)


@dataclass(frozen=True)
class Goodput:
    thresholds: tuple[float, ...] = Tiresias.thresholds
    starve: float = Tiresias.starve
    name: str = "goodput"

    def __post_init__(self) -> None:
        Tiresias(self.thresholds, self.starve)  # the same checks, in one place

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation:
        order = sorted(
            (j for j in jobs if j.active and runnable_counts(j)),
            key=lambda j: las_priority(j, now, self.thresholds, self.starve),
        )
        free = cluster.devices
        out: dict[str, int] = {}
        admitted: list[JobView] = []
        for job in order:  # 1. admission at the fewest devices
            if free <= 0:
                break
            low = runnable_counts(job)[0]
            if low <= free:
                out[job.id] = low
                free -= low
                admitted.append(job)
        for job in admitted:  # 2. running jobs keep what they hold
            held = job.allocated if job.state is JobState.RUNNING else 0
            if held > out[job.id] and held - out[job.id] <= free and held in runnable_counts(job):
                free -= held - out[job.id]
                out[job.id] = held
        heap: list[tuple[float, int, str]] = []
        by_id = {job.id: job for job in admitted}
        for rank, job in enumerate(admitted):  # 3. grow by marginal speed-up per device
            gain = self._gain(job, out[job.id], cluster)
            if gain is not None:
                heapq.heappush(heap, (-gain[0], rank, job.id))
        while heap and free > 0:
            _, rank, job_id = heapq.heappop(heap)
            job = by_id[job_id]
            gain = self._gain(job, out[job_id], cluster)
            if gain is None:
                continue
            step = gain[1] - out[job_id]
            if step > free:
                continue  # the next count does not fit; smaller jobs may still
            free -= step
            out[job_id] = gain[1]
            nxt = self._gain(job, out[job_id], cluster)
            if nxt is not None:
                heapq.heappush(heap, (-nxt[0], rank, job_id))
        return out

    def _gain(self, job: JobView, count: int, cluster: Cluster) -> tuple[float, int] | None:
        """(speed-up added per device, next count) of the job's next step up, None if none pays."""
        counts = runnable_counts(job)
        higher = [k for k in counts if k > count]
        if not higher:
            return None
        nxt = higher[0]
        now_s, next_s = _speedup(job, count), _speedup(job, nxt)
        held = job.allocated if job.state is JobState.RUNNING else 0
        if held and count == held:  # the first step beyond what it holds restarts it
            horizon = cluster.slice_s  # [Note: restart horizon]
            if job.remaining is not None:
                horizon = min(horizon, job.remaining * _speedup(job, job.devices) / now_s)
            if horizon <= job.restart_s:
                return None
            gained = next_s * (horizon - job.restart_s) - now_s * horizon
            per_device = gained / horizon / (nxt - count)
        else:
            per_device = (next_s - now_s) / (nxt - count)
        return (per_device, nxt) if per_device > 0 else None


def _speedup(job: JobView, count: int) -> float:
    if not job.speedup:
        return float(count)
    return job.speedup[count]
