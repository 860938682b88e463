"""The Python entry points: the same path the CLI takes, for scripts and notebooks.

    import polytrain
    job = polytrain.JobConfig()              # or polytrain.load("job.toml", **overrides)
    job.train.steps = 200
    run_dir = polytrain.run(job)             # validates, then starts job.launch.nproc workers

`polytrain.trainer.train(job)` runs one rank in the current process instead (what each worker
does; a one-rank job needs no launcher at all).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from polytrain.config.io import job_from_dict, load_job, merge, save_job
from polytrain.config.job import JobConfig
from polytrain.errors import ConfigError
from polytrain.launch.local import Interrupted, launch
from polytrain.trainer.auto import resolve_auto
from polytrain.trainer.outputs import RunLock, check_output_paths
from polytrain.trainer.ownership import newest_checkpoint_note
from polytrain.trainer.preflight import preflight

__all__ = ["load", "prepare", "run"]


def load(path: str | Path | None = None, **overrides: Any) -> JobConfig:
    """A job from a TOML file (or the defaults) with ``section__key=value`` overrides."""
    data: dict[str, Any] = load_job(path) if path else {}
    for key, value in overrides.items():
        merge(data, key.split("__"), value)
    return job_from_dict(data)


def _run_dir(job: JobConfig) -> Path:
    if job.observe.out_dir:
        run_dir = Path(job.observe.out_dir)
        if (run_dir / "metrics.jsonl").exists() and not job.checkpoint.resume:
            raise ConfigError(
                f"observe.out_dir = {str(run_dir)!r} already holds a run: choose another "
                "--out-dir, or pass --resume to continue it"
            )
        return run_dir
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path("runs") / stamp
    suffix = 1
    while run_dir.exists():
        run_dir = Path("runs") / f"{stamp}-{suffix}"
        suffix += 1
    return run_dir


def prepare(job: JobConfig) -> JobConfig:
    """Validate ``job`` as a whole (no processes started) and fix its run directory.

    A job with ``strategy = "auto"`` comes back as the planner's first plan
    (`polytrain.trainer.auto`): use the returned job."""
    if job.strategy == "auto":
        job = resolve_auto(job).job
    preflight(job)
    job.observe.out_dir = str(_run_dir(job))
    check_output_paths(job)  # again: the default run directory is known only now
    return job


def run(job: JobConfig) -> Path:
    """Validate, write ``<run dir>/job.toml`` and run the job's workers; return the run dir.

    Raises a `PolytrainError` for a mistake in the job, `polytrain.launch.WorkerFailure` when a
    worker fails.
    """
    job = prepare(job)
    run_dir = Path(job.observe.out_dir)
    with RunLock(run_dir):  # [Note: output paths]: one run per run directory at a time
        name = "job.toml" if not (run_dir / "job.toml").exists() else f"job-{time.time_ns()}.toml"
        job_path = run_dir / name
        save_job(job, job_path)
        try:
            launch(job, job_path, run_dir)
        except Interrupted as exc:
            raise Interrupted(exc.signal, newest_checkpoint_note(job)) from None
    return run_dir
