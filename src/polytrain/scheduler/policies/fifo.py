"""First in, first out: the baseline scheduling papers measure against (a cluster's default queue).

Jobs start in submission order on the devices they asked for and keep them until they finish
(non-preemptive). Without backfill a job that does not fit blocks every job behind it
(head-of-line blocking): a one-device job waits behind a 64-device job for the cluster to
drain. That is the usual baseline's behaviour, so it is the default; with
``backfill=True`` a later job that fits the free devices starts ahead of the blocked one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from polytrain.scheduler.jobs import JobState, JobView
from polytrain.scheduler.policies._fill import fill
from polytrain.scheduler.policy import Allocation, Cluster

__all__ = ["Fifo"]

_SUBMISSION = attrgetter("submitted", "id")


@dataclass(frozen=True)
class Fifo:
    backfill: bool = False
    name: str = "fifo"

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation:
        running: dict[str, int] = {}
        waiting: list[JobView] = []
        for j in jobs:  # one pass: a backlog of thousands is walked at every decision
            if j.state is JobState.RUNNING and j.allocated:
                running[j.id] = j.allocated
            elif j.active:
                waiting.append(j)
        waiting.sort(key=_SUBMISSION)
        free = cluster.devices - sum(running.values())
        return fill(waiting, free, backfill=self.backfill, start=running)
