"""Scheduling policies by name (`get_policy`).

[Note: placeholder policies] The two policies here are the local executor's stand-ins, so that
``polytrain sched serve`` runs on this branch: first-in-first-out and a Gandiva-style time
slicer. The policy package proper (fifo, srtf, tiresias, gandiva, goodput, with the simulator)
replaces this file at merge; keep ``get_policy(name) -> Policy`` and the names ``fifo`` and
``gandiva``. Both are pure: the same jobs, cluster and ``now`` give the same allocation.
"""

from __future__ import annotations

from collections.abc import Sequence

from polytrain.errors import ConfigError
from polytrain.scheduler.jobs import JobState, JobView
from polytrain.scheduler.policy import Allocation, Cluster, Policy

__all__ = ["POLICIES", "Fifo", "TimeSlice", "get_policy"]


class Fifo:
    """First come, first served, whole jobs, no preemption: a running job keeps its devices;
    the oldest waiting job starts when its ``devices`` are free and nothing younger passes it."""

    name = "fifo"

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation:
        out = {j.id: j.allocated for j in jobs if j.state == JobState.RUNNING}
        free = cluster.devices - sum(out.values())
        for job in sorted(jobs, key=lambda j: (j.submitted, j.id)):
            if not job.active or job.id in out:
                continue
            if job.devices > free:
                break
            out[job.id] = job.devices
            free -= job.devices
        return out


class TimeSlice:
    """Gandiva-style suspend/resume time slicing: a running job keeps its devices until its
    slice (``cluster.slice_s`` since it last started) has passed; then it competes again with
    the waiting jobs, least attained service first (Tiresias's order), oldest first on ties."""

    name = "gandiva"

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation:
        out: dict[str, int] = {}
        for job in jobs:
            in_slice = job.started is not None and now - job.started < cluster.slice_s
            if job.state == JobState.RUNNING and in_slice:
                out[job.id] = job.allocated
        free = cluster.devices - sum(out.values())
        contenders = [j for j in jobs if j.active and j.id not in out]
        for job in sorted(contenders, key=lambda j: (j.attained, j.submitted, j.id)):
            if job.devices <= free:
                out[job.id] = job.devices
                free -= job.devices
        return out


POLICIES: dict[str, type[Fifo] | type[TimeSlice]] = {"fifo": Fifo, "gandiva": TimeSlice}


def get_policy(name: str) -> Policy:
    """The policy called ``name``; a ConfigError listing the known ones."""
    if name not in POLICIES:
        raise ConfigError(f"--policy {name!r} is not a policy: choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()
