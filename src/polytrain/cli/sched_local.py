"""``polytrain sched serve | submit | status | cancel | logs``: the local executor's commands.

The commands share nothing but the state directory's database ([Note: scheduler state] in
scheduler/store.py): ``submit`` and ``cancel`` write it, ``serve`` polls it and runs the jobs,
so ``serve`` may be stopped and restarted at any time (docs/scheduler.md, "Local executor").

[Note: scheduler-owned keys] The scheduler sets, per start, ``launch.nproc`` (the devices the
policy gives; the job file's value is only the default request), ``train.device`` (serve's
``--device``), ``checkpoint.dir`` and ``observe.out_dir`` (under the state directory),
``checkpoint.resume`` and, where the job file has none, ``checkpoint.every``
(``DEFAULT_CHECKPOINTS`` saves over the run: a preemption waits at most about a twentieth of
the job for its checkpoint). A job file that sets one of these is accepted, and ``submit`` says
which of its values are not used: the same file keeps working under ``polytrain train``.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, Literal

import typer

from polytrain.api import prepare
from polytrain.cli.train import resolve_job
from polytrain.config.io import load_job
from polytrain.errors import ConfigError
from polytrain.scheduler.backend import Backend
from polytrain.scheduler.executor import (
    Executor,
    checkpoint_dir,
    log_file,
    request_cancel,
    run_dir,
)
from polytrain.scheduler.jobs import JobState
from polytrain.scheduler.local import LocalBackend
from polytrain.scheduler.policies import get_policy
from polytrain.scheduler.policy import Cluster, Policy
from polytrain.scheduler.progress import newest_checkpoint
from polytrain.scheduler.slurm import SlurmBackend
from polytrain.scheduler.store import JobRecord, Store, job_dir
from polytrain.trainer.auto import predict_job

__all__ = [
    "DEFAULT_CHECKPOINTS",
    "cancel_command",
    "logs_command",
    "parse_seconds",
    "resolve_policy",
    "serve_command",
    "status_command",
    "submit_command",
]

DEFAULT_CHECKPOINTS = 20  # checkpoints over a job whose file sets no checkpoint.every
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h)?\s*$")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, None: 1.0}
_LOCK = "serve.lock"

StateOption = Annotated[Path, typer.Option("--state", help="scheduler state directory")]


def resolve_policy(name: str) -> Policy:
    """The policy ``serve --policy NAME`` runs (`polytrain.scheduler.policies`)."""
    return get_policy(name)


def parse_seconds(text: str, flag: str) -> float:
    """``40m``, ``90s``, ``1.5h``, ``500ms`` or plain seconds -> seconds (positive)."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"{flag} {text!r}: give a positive duration such as 40m, 30s or 500ms")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


# -- serve -------------------------------------------------------------------------------------


def _lock(store: Store) -> int:
    """One serve per state directory: an flock the kernel drops when the process dies."""
    fd = os.open(store.dir / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            f"another `polytrain sched serve` (pid {holder}) serves {str(store.dir)!r}: "
            "stop it first, or use another --state"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def serve_command(
    state: StateOption,
    devices: Annotated[int, typer.Option(help="device slots of this host", min=1)],
    policy: Annotated[str, typer.Option(help="scheduling policy: fifo | gandiva | ...")] = "fifo",
    slice_: Annotated[str, typer.Option("--slice", help="time slice, e.g. 40m or 30s")] = "40m",
    device: Annotated[
        str, typer.Option(help="what jobs train on: cpu | cuda (one GPU per slot)")
    ] = "cpu",
    poll: Annotated[str, typer.Option(help="how often the state is read, e.g. 1s")] = "1s",
    until_idle: Annotated[
        bool, typer.Option(help="exit once every job is done (and there is one)")
    ] = False,
    slurm_nodes: Annotated[
        str,
        typer.Option(
            help="run the jobs on these Slurm nodes (comma list) through sbatch instead of on "
            "this host; --devices is then slots per node x nodes"
        ),
    ] = "",
    partition: Annotated[str, typer.Option(help="Slurm partition (with --slurm-nodes)")] = "",
) -> None:
    """Run the queued jobs of a state directory on this host's device slots, or on Slurm."""
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: choose cpu or cuda")
    kind: Literal["cpu", "cuda"] = "cuda" if device == "cuda" else "cpu"
    cluster = Cluster(devices, parse_seconds(slice_, "--slice"))
    poll_s = parse_seconds(poll, "--poll")
    chosen = resolve_policy(policy)
    store = Store(state, create=True)
    lock = _lock(store)
    stop: list[str] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.append(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        too_big = [j for j in store.jobs() if not j.state.done and j.min_devices > devices]
        if too_big:
            raise ConfigError(
                f"job {too_big[0].id!r} needs {too_big[0].min_devices} devices and --devices "
                f"is {devices}: give --devices {too_big[0].min_devices} or more, or cancel it"
            )
        held = [(max(j.placed), j.id) for j in store.jobs() if j.placed]
        if held and max(held)[0] >= devices:
            index, job_id = max(held)
            raise ConfigError(
                f"job {job_id!r} still runs on device {index} and --devices is {devices}: give "
                f"--devices {index + 1} or more until it ends, or cancel it"
            )
        store.set_cluster(devices, kind)
        typer.echo(
            f"polytrain: scheduling {store.dir} on {devices} {kind} slot(s), policy "
            f"{chosen.name}, slice {cluster.slice_s:g} s"
        )
        backend: Backend = LocalBackend(kind)
        if slurm_nodes:
            nodes = [n.strip() for n in slurm_nodes.split(",") if n.strip()]
            if devices % len(nodes):
                raise ConfigError(
                    f"--devices {devices} over {len(nodes)} Slurm node(s): give a multiple of "
                    "the node count (the same slots on every node)"
                )
            backend = SlurmBackend(
                nodes, devices // len(nodes), partition=partition or None, gpus=kind == "cuda"
            )
        executor = Executor(store, backend, chosen, cluster)
        executor.serve(poll_s, until_idle=until_idle, stopping=lambda: bool(stop))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(lock)
    if not stop:
        done = [str(j.state) for j in store.jobs()]
        counts = ", ".join(f"{done.count(s)} {s}" for s in sorted(set(done)))
        typer.echo(f"polytrain: every job is done: {counts}")
        return
    running = [j.id for j in store.jobs() if j.state in (JobState.RUNNING, JobState.PREEMPTING)]
    typer.echo(
        f"polytrain: scheduler stopped ({stop[0]}); {len(running)} job(s) keep running and "
        "are adopted by the next `polytrain sched serve` on this state directory"
    )


# -- submit ------------------------------------------------------------------------------------


def _overridden(data: dict[str, Any]) -> list[str]:
    """The scheduler-owned keys the job file sets ([Note: scheduler-owned keys])."""
    owned = {
        "train": ("device",),
        "checkpoint": ("dir", "resume"),
        "observe": ("out_dir",),
    }
    return [
        f"{section}.{key} = {data[section][key]!r}"
        for section, keys in owned.items()
        for key in keys
        if isinstance(data.get(section), dict) and key in data[section]
    ]


def _validate(
    job_file: Path, job_id: str, counts: set[int], device: str, every: int, store: Store
) -> None:
    """What ``polytrain train --config JOB --dry-run`` checks, with the flags each start gets
    (one run per device count the job may be given: its most and its fewest)."""
    for count in sorted(counts):
        flags = {
            "nproc": str(count),
            "device": device,
            "checkpoint_dir": str(checkpoint_dir(store, job_id)),
            "checkpoint_every": every,
            "out_dir": str(run_dir(store, job_id, 1)),
        }
        prepare(resolve_job(job_file, flags, []))


def planned_speedup(job_file: Path, device: str, most: int) -> dict[int, float]:
    """The planner's speed-up of a data-parallel job at 1..``most`` processes of this host
    (its step time at 1 over its step time at k, the global batch fixed), for the goodput
    policy; {} for a job whose layout does not scale with the process count (it sets dp, tp
    or pp, or uses another family) or that the planner cannot price."""
    written = load_job(job_file).get("parallel", {})  # dp is resolved from the world size
    if any(written.get(k, 1) != 1 for k in ("tp", "pp")) or written.get("dp", 0):
        return {}
    if written.get("sync", "allreduce") != "allreduce":
        return {}
    steps: dict[int, float] = {}
    for k in range(1, most + 1):
        estimate = predict_job(resolve_job(job_file, {"device": device, "nproc": str(k)}, []))
        if estimate.prediction is None:
            return {}
        steps[k] = estimate.prediction.step_s
    return {k: steps[1] / s for k, s in steps.items()}


def submit_command(
    job_file: Annotated[Path, typer.Argument(help="TOML job file, as `polytrain train` takes")],
    state: StateOption,
    name: Annotated[str | None, typer.Option(help="job id (default: the file's stem)")] = None,
    devices: Annotated[
        int | None, typer.Option(help="devices it asks for (default: launch.nproc, resolved)")
    ] = None,
    min_devices: Annotated[
        int | None, typer.Option(help="fewest devices it may run on (default: --devices)")
    ] = None,
    max_devices: Annotated[
        int | None,
        typer.Option(
            help="most devices an elastic policy (goodput) may give it, priced by the planner "
            "(default: --devices)"
        ),
    ] = None,
) -> None:
    """Validate a job file and queue it (a file that fails validation queues nothing)."""
    store = Store(state)
    slots, device = store.cluster()
    job_id = name if name is not None else job_file.stem
    if not _ID.match(job_id):
        raise ConfigError(
            f"job id {job_id!r}: use letters, digits, '.', '_' or '-' (at most 64), e.g. --name gpt-1"
        )
    if store.has(job_id):
        raise ConfigError(f"job id {job_id!r} is already in the queue: choose another --name")
    data = load_job(job_file)
    # Types and values, and launch.nproc as `train --device D` resolves it ("auto": 2 CPU
    # processes, or every visible GPU), before the counts are read.
    job = resolve_job(job_file, {"device": device}, [])
    count = job.launch.num_procs if devices is None else devices
    fewest = count if min_devices is None else min_devices
    if not 1 <= fewest <= count:
        raise ConfigError(
            f"--min-devices {fewest} with --devices {count}: give 1 <= --min-devices <= --devices"
        )
    if count > slots:
        raise ConfigError(
            f"job {job_id!r} asks for {count} devices and the cluster has {slots}: give "
            f"--devices {slots} or fewer"
        )
    most = count if max_devices is None else max_devices
    if most < count or most > slots:
        raise ConfigError(
            f"--max-devices {most} with --devices {count} on {slots} slots: give --devices <= "
            f"--max-devices <= {slots}"
        )
    if job.launch.nnodes != 1:
        raise ConfigError(
            f"launch.nnodes = {job.launch.nnodes}: the local executor runs one-node jobs; "
            "remove launch.nnodes from the job file"
        )
    every = job.checkpoint.every or max(1, job.train.steps // DEFAULT_CHECKPOINTS)
    _validate(job_file, job_id, {count, fewest, most}, device, every, store)
    speedup = planned_speedup(job_file, device, most)
    home = job_dir(store.dir, job_id)
    try:
        home.mkdir(parents=True)
    except FileExistsError:
        raise ConfigError(
            f"job id {job_id!r} already has a directory in {str(store.dir)!r}: choose another --name"
        ) from None
    stored = home / "job.toml"
    shutil.copyfile(job_file, stored)
    record = JobRecord(
        id=job_id,
        config=str(stored),
        workdir=str(Path.cwd()),
        devices=count,
        min_devices=fewest,
        max_devices=most,
        speedup=speedup,
        steps=job.train.steps,
        checkpoint_every=every,
        state=JobState.QUEUED,
        submitted=time.time(),
    )
    try:
        store.add(record)
    except ConfigError:
        shutil.rmtree(home)
        raise
    typer.echo(
        f"polytrain: queued {job_id!r}: {count} device(s) (fewest {fewest}), {job.train.steps} "
        f"steps, a checkpoint every {every}"
    )
    ignored = _overridden(data)
    if ignored:
        typer.echo(f"polytrain: the scheduler sets these itself; not used: {', '.join(ignored)}")


# -- status, cancel, logs ----------------------------------------------------------------------


def _row(store: Store, job: JobRecord, now: float) -> dict[str, Any]:
    attained = job.attained
    if job.started is not None:
        attained += job.allocated * max(0.0, now - job.started)
    return {
        "id": job.id,
        "state": str(job.state),
        "devices": job.devices,
        "min_devices": job.min_devices,
        "allocated": job.allocated,
        "placed": list(job.placed),
        "starts": job.starts,
        "checkpoint_step": newest_checkpoint(checkpoint_dir(store, job.id)),
        "steps": job.steps,
        "attained_device_s": round(attained, 3),
        "submitted": job.submitted,
        "exit_code": job.exit_code,
        "message": job.message,
    }


def status_command(
    state: StateOption,
    json_: Annotated[
        bool, typer.Option("--json", help="one JSON document, with histories")
    ] = False,
) -> None:
    """Every job: its state, devices, checkpoint progress and service so far."""
    store = Store(state)
    now = time.time()
    rows = [_row(store, job, now) for job in store.jobs()]
    if json_:
        for row in rows:
            row["events"] = store.events(row["id"])
        typer.echo(json.dumps({"jobs": rows}, indent=1))
        return
    header = f"{'ID':<20} {'STATE':<11} {'DEVICES':<8} {'PLACED':<10} {'STARTS':>6} {'STEP':>11} {'DEVICE-S':>9}"
    typer.echo(header)
    for r in rows:
        step = f"{r['checkpoint_step'] if r['checkpoint_step'] is not None else '-'}/{r['steps']}"
        typer.echo(
            f"{r['id']:<20} {r['state']:<11} {r['allocated']}/{r['devices']:<6} "
            f"{','.join(map(str, r['placed'])) or '-':<10} {r['starts']:>6} {step:>11} "
            f"{r['attained_device_s']:>9.1f}" + (f"  {r['message']}" if r["message"] else "")
        )


def cancel_command(
    job_id: Annotated[str, typer.Argument(help="job id")], state: StateOption
) -> None:
    """Cancel a job (a running one is stopped by the serve loop; its checkpoints stay)."""
    job = request_cancel(Store(state), job_id)
    if job.state == JobState.CANCELLED:
        typer.echo(f"polytrain: cancelled {job_id!r}")
    else:
        typer.echo(f"polytrain: cancel of {job_id!r} requested; the scheduler stops it")


def logs_command(
    job_id: Annotated[str, typer.Argument(help="job id")],
    state: StateOption,
    follow: Annotated[bool, typer.Option(help="keep printing until the job is done")] = False,
) -> None:
    """The output of every start of a job, oldest first."""
    store = Store(state)
    store.get(job_id)  # a one-line error for an unknown id
    printed: dict[int, int] = {}  # start -> bytes printed
    while True:
        job = store.get(job_id)
        for start in range(1, job.starts + 1):
            log = log_file(store, job_id, start)
            if not log.is_file():
                continue
            with log.open("rb") as f:
                f.seek(printed.get(start, 0))
                chunk = f.read()
            printed[start] = printed.get(start, 0) + len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()
        if not follow or job.state.done:
            return
        time.sleep(0.5)
