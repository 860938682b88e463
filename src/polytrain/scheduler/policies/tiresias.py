"""Tiresias's discretized two-dimensional least-attained-service (2D-LAS).

Gu et al., "Tiresias: A GPU Cluster Manager for Distributed Deep Learning", NSDI 2019.

A job's attained service is devices x seconds it has run (``JobView.attained``): a wide job
ages as fast as it consumes the cluster. Service is discretised into K priority queues by
``thresholds`` (K - 1 ascending bounds, device-seconds): a job starts in queue 0 and is demoted
when its service crosses a bound, so short jobs finish ahead of long ones without knowing any
duration. Within a queue jobs are served first come, first served (by submission), which
keeps the order stable and avoids the thrashing of continuous LAS. Each decision fills the
cluster in (queue, submission) order, skipping a job that does not fit; a running job that a
higher-priority job outranks is preempted there (decisions happen at events and slice
boundaries, so demotion is noticed at the next of those).

Starvation (Tiresias Algorithm 1, its PROMOTEKNOB): a job that has waited since it was last
preempted longer than ``starve`` x its executed time (seconds it has held devices in all) is
promoted to queue 0. Measured against its last run alone, a job preempted seconds after a
backfilled start would be promoted seconds later, outrank every new job (FIFO within queue 0 is
by submission) and be preempted again, over and over. The promotion is derived from the job's
own times, so ``decide`` stays pure: while the run that a promotion started lasts, the job stays
in queue 0 until it has attained another ``thresholds[0]`` in that run, which is Tiresias
resetting the promoted job's service.

Defaults: two queues (K = 2) with the bound at 3200 device-seconds, and ``starve`` = 8. They
are ours, chosen once before any benchmark ran, not values taken from the paper or fitted to the
trace; all are knobs.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from polytrain.errors import ConfigError
from polytrain.scheduler.jobs import JobState, JobView
from polytrain.scheduler.policies._fill import fill
from polytrain.scheduler.policy import Allocation, Cluster

__all__ = ["Tiresias", "las_priority"]


def las_priority(
    job: JobView, now: float, thresholds: Sequence[float], starve: float
) -> tuple[int, float, str]:
    """Sort key of discretised 2D-LAS: (queue, submission time, id); smaller runs first."""
    queue = bisect.bisect_right(thresholds, job.attained)
    if queue and starve > 0:
        if job.state is JobState.RUNNING and job.started is not None:
            this_run = now - job.started
            waited = job.started - job.waiting_since
            before = job.executed_s - this_run  # executed before this run
            if job.last_stopped is not None and waited >= starve * before:
                if this_run * job.allocated < thresholds[0]:
                    queue = 0
        elif job.last_stopped is not None and now - job.last_stopped >= starve * job.executed_s:
            queue = 0
    return (queue, job.submitted, job.id)


@dataclass(frozen=True)
class Tiresias:
    thresholds: tuple[float, ...] = (3200.0,)
    starve: float = 8.0
    name: str = "tiresias"

    def __post_init__(self) -> None:
        if list(self.thresholds) != sorted(set(self.thresholds)) or any(
            t <= 0 for t in self.thresholds
        ):
            raise ConfigError(
                f"tiresias thresholds = {list(self.thresholds)}: give positive, strictly "
                "ascending device-seconds"
            )
        if self.starve < 0:
            raise ConfigError(f"tiresias starve = {self.starve}: give 0 (off) or more")

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation:
        order = sorted(
            (j for j in jobs if j.active),
            key=lambda j: las_priority(j, now, self.thresholds, self.starve),
        )
        return fill(order, cluster.devices)
