"""Job traces from CSV: the Philly trace and any file with the documented columns.

Schema (a header row; column order free; other columns ignored)::

    submit time   ``submitted`` or ``timestamp``: seconds, or 'YYYY-mm-dd HH:MM:SS'   required
    duration      ``duration``: seconds the job ran on its devices (> 0)                required
    devices       ``devices`` or ``num_gpus``: devices the job asked for (>= 1)         required
    id            ``id``: unique job name (default ``line-<N>``)                         optional
    min devices   ``min_devices``: fewest devices it runs on (default 1)               optional
    model         ``model``: a speed-up class of :mod:`.speedup` (default by GPU-time)  optional

The Philly trace (Jeon et al., ATC'19; CSV as processed by the Pollux authors) has
``timestamp,duration,num_gpus,gpu_time,cluster``. Times are rebased so that the first
submission is at 0 s. A malformed row is a one-line error naming the file, the line and the fix.

Sampling (:func:`sample`): ``n`` jobs drawn uniformly at random without replacement with
``random.Random(seed)``, keeping their submission times: a seeded, reproducible thinning of the
whole trace (not a time window), so the sample keeps the trace's mix of sizes and its diurnal
and weekly arrival pattern at a lower rate.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from polytrain.errors import ConfigError
from polytrain.scheduler.speedup import MODEL_CLASSES, model_class_for

__all__ = ["TraceJob", "fit_cluster", "offered_load", "read_trace", "sample"]

_ALIASES = {"submitted": ("submitted", "timestamp"), "devices": ("devices", "num_gpus")}
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"  # read as UTC, so a sample is the same in every time zone
_Bad = Callable[[str, object, str], ConfigError]


@dataclass(frozen=True)
class TraceJob:
    """One job of a trace; ``line`` is its line in the file (errors name it)."""

    id: str
    submitted: float
    duration: float
    devices: int
    min_devices: int = 1
    model: str = "medium"
    line: int = 0


def read_trace(path: str | Path) -> list[TraceJob]:
    """Every job of the CSV at ``path`` in submission order, times from the first submission."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"trace {str(file)!r} does not exist: pass a CSV job trace")
    with file.open(newline="") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        columns = {key: _column(file, header, key) for key in ("submitted", "devices")}
        if "duration" not in header:
            raise ConfigError(f"{file}: no 'duration' column (header: {','.join(header)})")
        rows = [(reader.line_num, row) for row in reader]
    jobs = [_job(file, line, row, columns) for line, row in rows]
    seen: dict[str, int] = {}
    for job in jobs:
        if job.id in seen:
            raise ConfigError(
                f"{file}:{job.line}: job id {job.id!r} repeats line {seen[job.id]}: "
                "give every job its own id"
            )
        seen[job.id] = job.line
    if not jobs:
        raise ConfigError(f"{file}: no jobs in the trace: give at least one row")
    t0 = min(job.submitted for job in jobs)
    return sorted((_rebase(job, t0) for job in jobs), key=lambda job: (job.submitted, job.line))


def sample(jobs: Sequence[TraceJob], n: int, seed: int) -> list[TraceJob]:
    """``n`` jobs drawn at random with ``seed``, in submission order, rebased to start at 0."""
    if not 1 <= n <= len(jobs):
        raise ConfigError(f"--sample {n}: give 1..{len(jobs)} (the trace's jobs)")
    chosen = random.Random(seed).sample(list(jobs), n)
    t0 = min(job.submitted for job in chosen)
    return sorted((_rebase(job, t0) for job in chosen), key=lambda j: (j.submitted, j.line))


def fit_cluster(
    jobs: Sequence[TraceJob], devices: int, *, drop: bool = False
) -> tuple[list[TraceJob], int]:
    """The jobs that fit ``devices`` and how many were left out (only with ``drop``).

    Without ``drop`` a job asking more devices than exist is a one-line error: it could never
    run, and silently losing it would flatter every policy's figures."""
    kept = [job for job in jobs if job.devices <= devices]
    if len(kept) < len(jobs) and not drop:
        big = next(job for job in jobs if job.devices > devices)
        raise ConfigError(
            f"job {big.id!r} (line {big.line}) asks {big.devices} devices, the cluster has "
            f"{devices}: give --devices {big.devices} or more, or --drop-oversized to leave "
            f"out the {len(jobs) - len(kept)} such jobs"
        )
    return kept, len(jobs) - len(kept)


def offered_load(jobs: Sequence[TraceJob], devices: int) -> float:
    """Device-seconds asked / (devices x the span of submissions): above 1 the queue grows."""
    span = max(job.submitted for job in jobs) - min(job.submitted for job in jobs)
    work = sum(job.duration * job.devices for job in jobs)
    return work / (devices * span) if span > 0 else float("inf")


def _column(file: Path, header: Sequence[str], key: str) -> str:
    for name in _ALIASES[key]:
        if name in header:
            return name
    raise ConfigError(
        f"{file}: no {' or '.join(repr(n) for n in _ALIASES[key])} column "
        f"(header: {','.join(header)})"
    )


def _job(file: Path, line: int, row: dict[str, str | None], columns: dict[str, str]) -> TraceJob:
    def bad(what: str, value: object, fix: str) -> ConfigError:
        return ConfigError(f"{file}:{line}: {what} {value!r}: {fix}")

    if None in row or any(v is None for v in row.values()):
        given = sum(len(v) if isinstance(v, list) else v is not None for v in row.values())
        raise bad("row has", given, f"give one value per column ({len(row) - (None in row)})")
    raw_time = (row[columns["submitted"]] or "").strip()
    try:
        submitted = float(raw_time)
    except ValueError:
        try:
            submitted = (
                datetime.strptime(raw_time, _TIME_FORMAT).replace(tzinfo=timezone.utc).timestamp()
            )
        except ValueError:
            raise bad("submit time", raw_time, "give seconds or 'YYYY-mm-dd HH:MM:SS'") from None
    raw_duration = (row["duration"] or "").strip()
    try:
        duration = float(raw_duration)
    except ValueError:
        duration = -1.0
    if not duration > 0 or duration == float("inf"):
        raise bad("duration", raw_duration, "give positive seconds")
    devices = _count(row[columns["devices"]], "devices", bad)
    min_devices = _count(row.get("min_devices") or "1", "min_devices", bad)
    if min_devices > devices:
        raise bad("min_devices", min_devices, f"give at most the job's devices ({devices})")
    model = (row.get("model") or "").strip() or model_class_for(duration, devices)
    if model not in MODEL_CLASSES:
        raise bad("model", model, f"give one of {', '.join(MODEL_CLASSES)} or leave it empty")
    job_id = (row.get("id") or "").strip() or f"line-{line}"
    return TraceJob(job_id, submitted, duration, devices, min_devices, model, line)


def _count(raw: str | None, what: str, bad: _Bad) -> int:
    text = (raw or "").strip()
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise bad(what, text, "give a whole number >= 1")
    return value


def _rebase(job: TraceJob, t0: float) -> TraceJob:
    return TraceJob(
        job.id, job.submitted - t0, job.duration, job.devices, job.min_devices, job.model, job.line
    )
