"""The Python entry points: the same path the CLI takes, for scripts and notebooks.

    import polytrain
    job = polytrain.JobConfig()              # or polytrain.load("job.toml", **overrides)
    job.train.steps = 200
    run_dir = polytrain.run(job)             # validates, then starts job.launch.nproc workers

`polytrain.trainer.train(job)` runs one rank in the current process instead (what each worker
does; a one-rank job needs no launcher at all).

``run(job, model=make_model, data={"input_ids": ..., "targets": ...})`` also takes the model as
a factory function and the data as tensors (docs/models.md, [Note: objects to workers]).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from polytrain.config.io import job_from_dict, load_job, merge, save_job
from polytrain.config.job import JobConfig
from polytrain.errors import ConfigError
from polytrain.launch.local import Interrupted, launch
from polytrain.trainer.auto import resolve_auto
from polytrain.trainer.build import strategy_family
from polytrain.trainer.outputs import RunLock, check_output_paths
from polytrain.trainer.ownership import newest_checkpoint_note
from polytrain.trainer.preflight import preflight

__all__ = ["factory_name", "load", "prepare", "run"]

DataArg = Mapping[str, torch.Tensor] | tuple[torch.Tensor, torch.Tensor]


def load(path: str | Path | None = None, **overrides: Any) -> JobConfig:
    """A job from a TOML file (or the defaults) with ``section__key=value`` overrides;
    ``model__name`` may be the factory function itself ([Note: objects to workers])."""
    data: dict[str, Any] = load_job(path) if path else {}
    for key, value in overrides.items():
        if key == "model__name" and callable(value):  # a factory travels as its import path
            value = factory_name(value)
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


def factory_name(factory: Callable[..., Any]) -> str:
    """``package.module:function`` of a module-level function, as ``model.name`` takes it.

    [Note: objects to workers] Workers are separate processes started by the elastic agent; they
    receive the job as TOML, never pickled objects. A factory therefore travels as its import
    path (a function defined in the script being run is imported from that script's file, so
    the script needs the usual ``if __name__ == "__main__":`` guard), and tensors as a
    ``.safetensors`` file in the run directory.
    """
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", "")
    if module == "__main__":
        main_file = getattr(sys.modules["__main__"], "__file__", None)
        module = Path(main_file).stem if main_file else None
    if not module or not qualname or "<" in qualname:
        raise ConfigError(
            f"model = {factory!r} cannot reach the worker processes: define the factory at the "
            "top level of a module or script (not a lambda or nested function)"
        )
    return f"{module}:{qualname}"


def _write_data(data: DataArg, run_dir: Path) -> str:
    if isinstance(data, tuple):
        tensors = {"inputs": data[0], "targets": data[1]}
    else:
        tensors = dict(data)
    path = run_dir / "data.safetensors"
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def run(
    job: JobConfig,
    *,
    model: Callable[..., Any] | None = None,
    data: DataArg | None = None,
) -> Path:
    """Validate, write ``<run dir>/job.toml`` and run the job's workers; return the run dir.

    ``model`` (a factory function) replaces ``job.model.name``; ``data`` (``(inputs, targets)``
    or named tensors with ``targets``) replaces ``job.data.source`` ([Note: objects to workers]).
    Raises a `PolytrainError` for a mistake in the job, `polytrain.launch.WorkerFailure` when a
    worker fails.
    """
    if model is not None:
        job.model.name = factory_name(model)
    if data is not None:
        run_dir = Path(_run_dir(job))
        run_dir.mkdir(parents=True, exist_ok=True)
        job.data.source = _write_data(data, run_dir)
        job.observe.out_dir = str(run_dir)
    job = prepare(job)
    run_dir = Path(job.observe.out_dir)
    with RunLock(run_dir):  # [Note: output paths]: one run per run directory at a time
        name = "job.toml" if not (run_dir / "job.toml").exists() else f"job-{time.time_ns()}.toml"
        job_path = run_dir / name
        save_job(job, job_path)
        try:
            family = strategy_family(job)
            launch(job, job_path, run_dir, family.tolerated_ranks(job), family.rank_roles(job))
        except Interrupted as exc:
            raise Interrupted(exc.signal, newest_checkpoint_note(job)) from None
    return run_dir
