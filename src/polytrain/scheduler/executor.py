"""The control loop: ask the policy at events and slice boundaries, then start, preempt, resume.

One `Executor.tick` reads the store, acts through a `Backend`, and records every state change
with `Store.transition` (a scheduler killed between any two steps is put right by `recover`):

1. jobs that ended (``Backend.poll``) become finished or failed;
2. cancel requests stop their jobs;
3. [Note: preemption by checkpoint] a job being preempted keeps running until a checkpoint
   newer than the request has landed (its newest checkpoint step at request time is stored
   as ``preempt_step``); only then is it stopped and suspended. It resumes from that
   checkpoint: only the steps it ran after it before the stop (about a poll period) are
   redone, and a later save that the stop interrupts is an uncommitted ``.tmp`` the trainer
   ignores. A job whose newest checkpoint is its final step is left to finish by itself: the
   trainer refuses to resume a checkpoint at ``train.steps``, and it is about to write its
   final weights;
4. at an event (a submission, an end, a stop) or a slice boundary the policy decides; running
   jobs whose count changes are preempted (a resize is a preempt and a resume on the new
   count); waiting jobs start where `policy.place` finds their devices free. Devices of a job
   still being preempted are not free: a job placed on them starts at the event its stop is.

Time is wall-clock seconds (``time.time``) by default, injectable for tests: attained service
(device-seconds) keeps counting while the scheduler is down, since the jobs kept running.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError
from polytrain.scheduler.backend import Backend, Launch
from polytrain.scheduler.jobs import JobState, JobView
from polytrain.scheduler.policy import Cluster, Policy, check_allocation, place
from polytrain.scheduler.progress import newest_checkpoint, seconds_per_step
from polytrain.scheduler.store import JobRecord, Store, job_dir

__all__ = ["Executor", "checkpoint_dir", "log_file", "request_cancel", "run_dir"]

_HOLDING = (JobState.RUNNING, JobState.PREEMPTING)


def checkpoint_dir(store: Store, job_id: str) -> Path:
    return job_dir(store.dir, job_id) / "checkpoints"


def run_dir(store: Store, job_id: str, start: int) -> Path:
    """``observe.out_dir`` of the job's ``start``-th run (1-based); its log is beside it."""
    return job_dir(store.dir, job_id) / f"start-{start}"


def log_file(store: Store, job_id: str, start: int) -> Path:
    """stdout and stderr of the job's ``start``-th run."""
    return job_dir(store.dir, job_id) / f"start-{start}.log"


def request_cancel(store: Store, job_id: str) -> JobRecord:
    """Cancel a job: at once if it holds no devices, else by asking the serve loop to stop it."""
    job = store.get(job_id)
    if job.state.done:
        raise ConfigError(f"job {job_id!r} is already {job.state}: nothing to cancel")
    waiting = (JobState.QUEUED, JobState.SUSPENDED)
    if job.state in waiting:
        try:
            return store.transition(job_id, JobState.CANCELLED, expect=waiting, note="cancelled")
        except ConfigError:  # the serve loop started it meanwhile: ask it to stop the job
            pass
    return store.update(job_id, cancel_requested=True)


class Executor:
    """Runs the jobs of ``store`` on ``cluster`` through ``backend`` as ``policy`` decides."""

    def __init__(
        self,
        store: Store,
        backend: Backend,
        policy: Policy,
        cluster: Cluster,
        *,
        clock: Callable[[], float] = time.time,
        checkpoints: Callable[[Path], int | None] = newest_checkpoint,
    ) -> None:
        self.store, self.backend, self.policy, self.cluster = store, backend, policy, cluster
        self.clock, self.checkpoints = clock, checkpoints
        self._boundary: float | None = None  # the next slice boundary
        self._seen: set[str] = set()  # job ids the policy has been asked about

    # -- restart -----------------------------------------------------------------------------

    def recover(self) -> None:
        """After a restart: adopt the jobs whose processes still run (or ended with an exit
        code while the scheduler was down); the others go back to suspended and resume from
        their newest checkpoint. Their devices are known from the store."""
        now = self.clock()
        for job in self.store.jobs():
            if job.state not in _HOLDING:
                continue
            if self.backend.adopt(self._launch(job, job.placed, job.starts)):
                continue
            note = "its processes were gone when the scheduler restarted"
            if job.state == JobState.RUNNING:
                self.store.transition(job.id, JobState.PREEMPTING, note=note, now=now)
            self._release(job, JobState.SUSPENDED, now, note)

    # -- one round ---------------------------------------------------------------------------

    def tick(self) -> bool:
        """One pass of the loop (module docstring); True if the policy was asked."""
        now = self.clock()
        event = False
        for job_id, code in self.backend.poll().items():
            event |= self._ended(job_id, code, now)
        for job in self.store.jobs():
            if job.cancel_requested and not job.state.done:
                if job.state in _HOLDING:
                    self.backend.stop(job.id)
                self._release(job, JobState.CANCELLED, now, "cancelled")
                event = True
            elif job.state == JobState.PREEMPTING and self._checkpointed(job):
                self.backend.stop(job.id)
                self._release(job, JobState.SUSPENDED, now, "preempted after its checkpoint")
                event = True
        ids = {job.id for job in self.store.jobs()}
        event |= not ids <= self._seen
        if self._boundary is None or now >= self._boundary:
            event = True
            self._boundary = now + self.cluster.slice_s
        if event:
            self._seen = ids
            self._decide(now)
        return event

    def idle(self) -> bool:
        """Every job is done (and there is at least one)."""
        jobs = self.store.jobs()
        return bool(jobs) and all(job.state.done for job in jobs)

    def serve(
        self,
        poll_s: float,
        *,
        until_idle: bool = False,
        stopping: Callable[[], bool] = lambda: False,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`recover`, then `tick` every ``poll_s`` until ``stopping()`` (or, with
        ``until_idle``, until every job is done)."""
        self.recover()
        while not stopping():
            self.tick()
            if until_idle and self.idle():
                return
            sleep(poll_s)

    # -- the steps ---------------------------------------------------------------------------

    def _checkpointed(self, job: JobRecord) -> bool:
        """[Note: preemption by checkpoint]: a checkpoint newer than the request, not the last."""
        newest = self.checkpoints(checkpoint_dir(self.store, job.id))
        asked = -1 if job.preempt_step is None else job.preempt_step
        return newest is not None and asked < newest < job.steps

    def _ended(self, job_id: str, code: int, now: float) -> bool:
        job = self.store.get(job_id)
        if job.state not in _HOLDING:  # stopped by us meanwhile
            return False
        new = JobState.FINISHED if code == 0 else JobState.FAILED
        why = "" if code == 0 else f"exit code {code}: see `polytrain sched logs {job_id}`"
        self._release(job, new, now, why or "finished", exit_code=code, message=why)
        return True

    def _release(
        self, job: JobRecord, new: JobState, now: float, note: str, **changes: Any
    ) -> None:
        """Move a job to ``new``, free its devices, and book the service its run got."""
        attained, executed = job.attained, job.executed
        if job.state in _HOLDING and job.started is not None:
            attained += job.allocated * max(0.0, now - job.started)
            executed += max(0.0, now - job.started)
        self.store.transition(
            job.id,
            new,
            note=note,
            now=now,
            attained=attained,
            executed=executed,
            last_stopped=now,
            allocated=0,
            last_allocated=job.allocated or job.last_allocated,
            placed=(),
            started=None,
            preempt_at=None,
            preempt_step=None,
            **changes,
        )

    def _view(self, job: JobRecord, now: float) -> JobView:
        attained, executed = job.attained, job.executed
        if job.state in _HOLDING and job.started is not None:
            attained += job.allocated * max(0.0, now - job.started)
            executed += max(0.0, now - job.started)
        return JobView(
            id=job.id,
            submitted=job.submitted,
            devices=job.devices,
            state=job.state,
            allocated=job.allocated,
            min_devices=job.min_devices,
            attained=attained,
            remaining=self._remaining(job),
            started=job.started if job.state in _HOLDING else None,
            first_started=job.first_started,
            max_devices=job.max_devices,
            speedup=job.speedup,
            last_stopped=job.last_stopped,
            executed_s=executed,
        )

    def _remaining(self, job: JobRecord) -> float | None:
        """Seconds left at ``job.devices`` devices: steps left (after the newest checkpoint)
        times the last logged step time, scaled linearly from the count it was measured on."""
        measured_on = job.allocated or job.last_allocated
        if job.starts == 0 or measured_on == 0:
            return None
        per_step = seconds_per_step(run_dir(self.store, job.id, job.starts))
        if per_step is None:
            return None
        done = self.checkpoints(checkpoint_dir(self.store, job.id)) or 0
        return max(0, job.steps - done) * per_step * measured_on / job.devices

    def _decide(self, now: float) -> None:
        jobs = [job for job in self.store.jobs() if not job.state.done]
        views = [self._view(job, now) for job in jobs]
        allocation = self.policy.decide(views, self.cluster, now)
        check_allocation(allocation, views, self.cluster)
        held: dict[str, tuple[int, ...]] = {}
        for job in jobs:
            if job.state == JobState.RUNNING and allocation.get(job.id, 0) != job.allocated:
                newest = self.checkpoints(checkpoint_dir(self.store, job.id))
                self.store.transition(
                    job.id,
                    JobState.PREEMPTING,
                    note=f"policy {self.policy.name}: {job.allocated} -> "
                    f"{allocation.get(job.id, 0)} devices",
                    now=now,
                    preempt_at=now,
                    preempt_step=-1 if newest is None else newest,
                )
            if job.state in _HOLDING:  # still on its devices (a preempted one until stopped)
                held[job.id] = job.placed
        waiting = [j for j in jobs if j.state in (JobState.QUEUED, JobState.SUSPENDED)]
        for job in sorted(waiting, key=lambda j: (-allocation.get(j.id, 0), j.submitted)):
            count = allocation.get(job.id, 0)
            if count:
                want = {**{k: len(v) for k, v in held.items()}, job.id: count}
                try:
                    devices = place(want, held, self.cluster.devices)[job.id]
                except ConfigError:  # its devices are still being freed: next event
                    continue
                if self._start(job, devices, now):
                    held[job.id] = devices

    def _start(self, job: JobRecord, devices: tuple[int, ...], now: float) -> bool:
        start = job.starts + 1
        try:
            job = self.store.transition(
                job.id,
                JobState.RUNNING,
                expect=(JobState.QUEUED, JobState.SUSPENDED),
                note=f"start {start} on devices {list(devices)}",
                now=now,
                allocated=len(devices),
                placed=devices,
                started=now,
                first_started=job.first_started if job.first_started is not None else now,
                starts=start,
            )
        except ConfigError:  # cancelled meanwhile
            return False
        try:
            self.backend.start(self._launch(job, devices, start))
        except OSError as exc:
            self._release(job, JobState.FAILED, now, "start failed", message=str(exc))
            return False
        return True

    def _launch(self, job: JobRecord, devices: tuple[int, ...], start: int) -> Launch:
        ckpt = checkpoint_dir(self.store, job.id)
        run = run_dir(self.store, job.id, start)
        return Launch(
            job_id=job.id,
            config=Path(job.config),
            devices=tuple(devices),
            run_dir=run,
            checkpoint_dir=ckpt,
            checkpoint_every=job.checkpoint_every,
            resume=self.checkpoints(ckpt) is not None,
            log=log_file(self.store, job.id, start),
            workdir=Path(job.workdir),
        )
