"""What an executor asks of the machines it runs jobs on: start, stop, and who has ended.

The executor (the control loop that asks the policy, keeps the SQLite state and decides when a
preempted job may be stopped) is the same for every backend; a backend only launches
``polytrain train`` on the devices it is given and reports exit codes. Local slots run the
CLI as child processes; Slurm submits a generated batch script.

Preemption by checkpoint: the executor asks nothing special of the trainer. A job runs with a
checkpoint cadence; at a slice boundary the executor marks it preempting, waits until a
checkpoint newer than that moment has landed in ``checkpoint_dir``, then calls ``stop``. The
job resumes later (``resume = True``) on whatever devices the policy then gives it: resuming
under another layout is the trainer's own feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = ["Backend", "Launch"]


@dataclass(frozen=True)
class Launch:
    """One start of one job: its validated job file, devices, and where it writes."""

    job_id: str
    config: Path  # the job's TOML as the scheduler stored it
    devices: tuple[int, ...]  # device indices from policy.place
    run_dir: Path  # observe.out_dir of this start (a fresh one per start)
    checkpoint_dir: Path  # the same for every start of the job
    checkpoint_every: int
    resume: bool  # False on the first start only
    log: Path  # stdout and stderr of this start
    workdir: Path | None = None  # where the job was submitted: its relative paths mean this


class Backend(Protocol):
    name: str

    def start(self, launch: Launch) -> None:
        """Launch the job; return once it is submitted (not when it ends)."""
        ...

    def stop(self, job_id: str) -> None:
        """End a running job now (its last checkpoint is what it keeps)."""
        ...

    def poll(self) -> dict[str, int]:
        """Jobs that ended since the last poll, with their exit codes (0 = finished)."""
        ...

    def adopt(self, launch: Launch) -> bool:
        """Take over a job that an earlier executor process started with ``launch`` (the
        scheduler was restarted): True if it is still running or ended with an exit code that
        the next `poll` reports; False if it is gone without one (it resumes from its newest
        checkpoint)."""
        ...
