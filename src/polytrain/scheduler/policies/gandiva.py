"""Gandiva-style time slicing: over-subscribed jobs take turns, one slice at a time.

Xiao et al., "Gandiva: Introspective Cluster Scheduling for Deep Learning", OSDI 2018
(suspend-resume and time slicing). Only the time slicing is modelled, not Gandiva's packing,
migration or grow-shrink.

While every active job fits, every job runs. When the cluster is over-subscribed, jobs share
it round-robin in slices of ``cluster.slice_s``: at a slice boundary (``now`` a whole multiple
of the slice) the cluster is refilled in least-recently-run order (the job that has waited
longest since it last held devices first, running jobs last, the most recently started of
those kept first), skipping a job that does not fit. Between boundaries (at a submission or a
completion) running jobs keep their devices and only free devices are handed out, in the same
order: a job is preempted only at a slice boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from polytrain.scheduler.jobs import JobState, JobView
from polytrain.scheduler.policies._fill import fill
from polytrain.scheduler.policy import Allocation, Cluster

__all__ = ["Gandiva", "at_slice_boundary"]


def at_slice_boundary(now: float, slice_s: float) -> bool:
    """Is ``now`` a whole multiple of the slice (to a microsecond)?"""
    turns = now / slice_s
    return math.isclose(turns, round(turns), rel_tol=0.0, abs_tol=1e-6 / slice_s) and now > 0


def _lru(job: JobView) -> tuple[int, float, str]:
    if job.state is JobState.RUNNING and job.started is not None:
        return (1, -job.started, job.id)
    return (0, job.waiting_since, job.id)


@dataclass(frozen=True)
class Gandiva:
    name: str = "gandiva"

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation:
        active = [j for j in jobs if j.active]
        order = sorted(active, key=_lru)
        if at_slice_boundary(now, cluster.slice_s):
            return fill(order, cluster.devices)
        running = {j.id: j.allocated for j in active if j.state is JobState.RUNNING and j.allocated}
        waiting = [j for j in order if j.id not in running]
        return fill(waiting, cluster.devices - sum(running.values()), start=running)
