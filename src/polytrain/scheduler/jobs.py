"""A scheduled job's states, its legal transitions, and the view a policy decides from.

States (Tiresias / Gandiva vocabulary)::

    queued ──▶ running ──▶ finished | failed
      │  ▲        │
      │  │        ▼
      │  └── suspended ◀── preempting      (preempted at a slice boundary by checkpoint)
      ▼
    cancelled   (from queued, running, preempting or suspended)

A job that is resized (another device count) goes running -> preempting -> suspended ->
running: it checkpoints and resumes under another layout. Pure: no torch, no clock of its own.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from polytrain.errors import ConfigError

__all__ = ["TRANSITIONS", "JobState", "JobView", "advance"]


class JobState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    PREEMPTING = "preempting"
    SUSPENDED = "suspended"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value

    @property
    def done(self) -> bool:
        return self in (JobState.FINISHED, JobState.FAILED, JobState.CANCELLED)


TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {JobState.PREEMPTING, JobState.FINISHED, JobState.FAILED, JobState.CANCELLED}
    ),
    # A job told to stop may finish (or fail) before its checkpoint lands.
    JobState.PREEMPTING: frozenset(
        {JobState.SUSPENDED, JobState.FINISHED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.SUSPENDED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.FINISHED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


def advance(job_id: str, old: JobState, new: JobState) -> JobState:
    """``new`` if ``old -> new`` is legal, else a ConfigError naming the job and both states."""
    if new not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(TRANSITIONS[old])) or "none (it is done)"
        raise ConfigError(f"job {job_id!r} cannot go from {old} to {new} (allowed: {allowed})")
    return new


@dataclass(frozen=True)
class JobView:
    """What a policy sees of one job at one instant; policies never mutate it.

    ``devices`` is what the job asked for (its maximum under an elastic policy) and
    ``min_devices`` the fewest it can run on. ``attained`` is device-seconds of service so far
    (Tiresias's two-dimensional attained service). ``remaining`` is the estimated seconds of work
    left at ``devices`` devices, None where unknown (shortest-remaining-first needs it; a
    trace's duration gives it in the simulator). ``speedup`` maps a device count to the job's
    throughput relative to one device (the planner's predicted steps per second, normalised);
    absent counts are not runnable. ``restart_s`` is what a preemption or resize costs the job
    (checkpoint, relaunch, restore). ``last_stopped`` is when the job last lost its devices
    (None: it never ran) and ``executed_s`` the seconds it has held devices so far, the current
    run included: least-recently-run order (Gandiva) and Tiresias's starvation promotion read
    them."""

    id: str
    submitted: float
    devices: int
    state: JobState = JobState.QUEUED
    allocated: int = 0
    min_devices: int = 1
    attained: float = 0.0
    remaining: float | None = None
    started: float | None = None  # when the job last started running (None: not running)
    first_started: float | None = None
    speedup: Mapping[int, float] = field(default_factory=dict)
    restart_s: float = 0.0
    max_devices: int = 0  # the most an elastic policy may give it (0: ``devices``)
    last_stopped: float | None = None
    executed_s: float = 0.0

    @property
    def ceiling(self) -> int:
        """The most devices any policy may give the job: ``max_devices`` where the job lets an
        elastic policy grow it past its ask (Pollux's jobs are sized by the scheduler), else
        ``devices``."""
        return max(self.devices, self.max_devices)

    @property
    def waiting_since(self) -> float:
        """Since when a job that holds no devices has been waiting (stopped, else submitted)."""
        return self.submitted if self.last_stopped is None else self.last_stopped

    active: bool = field(init=False, repr=False, compare=False)
    """Waiting for or holding devices (not done, not being stopped). A field set once rather
    than a property: policies read it of every job at every decision."""

    def __post_init__(self) -> None:
        active = self.state in (JobState.QUEUED, JobState.RUNNING, JobState.SUSPENDED)
        object.__setattr__(self, "active", active)
