"""The policy contract: a pure function of (jobs, cluster, now) -> how many devices each job holds.

A policy returns an :class:`Allocation` for the next interval: job id -> device count, 0 or
absent meaning "not running". The simulator and the executors compare it with what each job
holds now and act: start a queued or suspended job, preempt a running one (checkpoint, then
stop), resize one (preempt, then start on the new count). A policy never places devices;
:func:`place` does, the same way for the simulator and every executor, keeping a running job
on the devices it holds so that no two jobs ever share one.

Policies are called at every event (a submission, a completion) and at every slice boundary
(``slice_s``; time-slicing policies preempt only there). They read ``now`` from their argument,
never from a clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from polytrain.errors import ConfigError
from polytrain.scheduler.jobs import JobView

__all__ = ["Allocation", "Cluster", "Policy", "check_allocation", "place"]

Allocation = Mapping[str, int]


@dataclass(frozen=True)
class Cluster:
    """``devices`` identical device slots; ``slice_s`` the time slice (seconds)."""

    devices: int
    slice_s: float = 2400.0  # 40 minutes: the low end of production slices

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ConfigError(f"cluster devices = {self.devices}: give at least 1")
        if not self.slice_s > 0:
            raise ConfigError(f"slice = {self.slice_s} s: give a positive time slice")


class Policy(Protocol):
    """``decide`` is pure: the same jobs, cluster and ``now`` give the same allocation."""

    @property
    def name(self) -> str: ...  # read-only, so frozen dataclasses implement it

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation: ...


def check_allocation(allocation: Allocation, jobs: Sequence[JobView], cluster: Cluster) -> None:
    """Refuse an allocation no executor may act on (a policy bug, named)."""
    known = {job.id: job for job in jobs}
    total = 0
    for job_id, count in allocation.items():
        if count == 0:
            continue
        job = known.get(job_id)
        if job is None or not job.active:
            raise ConfigError(f"allocation gives {count} devices to {job_id!r}, not an active job")
        if count < job.min_devices or count > min(job.ceiling, cluster.devices):
            raise ConfigError(
                f"allocation gives {job_id!r} {count} devices (it runs on "
                f"{job.min_devices}..{job.ceiling}, the cluster has {cluster.devices})"
            )
        total += count
    if total > cluster.devices:
        raise ConfigError(f"allocation uses {total} devices; the cluster has {cluster.devices}")


def place(
    allocation: Allocation, held: Mapping[str, Sequence[int]], devices: int
) -> dict[str, tuple[int, ...]]:
    """Device indices for every job the allocation runs, no index used twice.

    A job that keeps its count keeps its devices (no needless restart); the others are given
    free indices lowest first, contiguous where possible (fewer hosts crossed on a real
    cluster)."""
    out: dict[str, tuple[int, ...]] = {}
    for job_id, count in allocation.items():
        if count and len(held.get(job_id, ())) == count:
            out[job_id] = tuple(held[job_id])
    used = {d for ds in out.values() for d in ds}
    free = [d for d in range(devices) if d not in used]
    for job_id, count in sorted(allocation.items(), key=lambda item: -item[1]):
        if not count or job_id in out:
            continue
        if count > len(free):
            raise ConfigError(f"no room for {job_id!r}: {count} devices asked, {len(free)} free")
        run = _contiguous(free, count)
        out[job_id] = run
        free = [d for d in free if d not in run]
    return out


def _contiguous(free: list[int], count: int) -> tuple[int, ...]:
    for start in range(len(free) - count + 1):
        window = free[start : start + count]
        if window[-1] - window[0] == count - 1:
            return tuple(window)
    return tuple(free[:count])
