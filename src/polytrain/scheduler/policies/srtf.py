"""Shortest remaining time first, preemptive: the clairvoyant reference point.

At every decision (a submission, a completion, a slice boundary) the active jobs are ranked by
``remaining`` (seconds left at their requested devices; unknown counts as infinite) and the
cluster is filled in that order, skipping a job that does not fit. A running job that falls out
of the top is preempted at that decision, so preemption happens at events and slice
boundaries, never in between. SRTF needs the remaining time, which real clusters rarely know:
it is the clairvoyant reference, not a deployable policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from polytrain.scheduler.jobs import JobView
from polytrain.scheduler.policies._fill import fill
from polytrain.scheduler.policy import Allocation, Cluster

__all__ = ["Srtf"]


@dataclass(frozen=True)
class Srtf:
    name: str = "srtf"

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation:
        def key(j: JobView) -> tuple[float, float, str]:
            return (math.inf if j.remaining is None else j.remaining, j.submitted, j.id)

        return fill(sorted((j for j in jobs if j.active), key=key), cluster.devices)
