"""Pipeline job checks that need no processes: combinations the runtime does not offer."""

from __future__ import annotations

from polytrain.config.job import JobConfig
from polytrain.errors import ConfigError
from polytrain.pipeline.schedule import (
    NEXT_SCHEDULE_NAMES,
    build_staged,
    stages_per_rank,
    zero_stages_problem,
)

__all__ = [
    "check_pipeline_job",
    "check_schedule_options",
    "check_zero_stages",
    "num_pipeline_stages",
]


def num_pipeline_stages(job: JobConfig) -> int:
    """Stages the model is cut into: ``parallel.pp`` times the stages each rank holds."""
    pl = job.pipeline
    return job.parallel.pp * stages_per_rank(pl.schedule, pl.virtual_stages)


def check_schedule_options(job: JobConfig) -> None:
    """Raise a one-line `ConfigError` for schedule options that do not fit together: virtual
    stages with a schedule that does not use them, what the schedules with several stages per
    rank or an I/W split do not offer, and a micro-batch count the schedule cannot use."""
    p, pl = job.parallel, job.pipeline
    name, v = pl.schedule, pl.virtual_stages
    if name == "interleaved-1f1b" and v < 2:
        raise ConfigError(
            f"pipeline.schedule = 'interleaved-1f1b' with pipeline.virtual_stages = {v}: "
            "interleaving needs 2 or more stages per rank; set --virtual-stages 2 (with 1 it "
            "is 1f1b)"
        )
    if v != 1 and name != "interleaved-1f1b" and v != stages_per_rank(name):
        raise ConfigError(
            f"pipeline.virtual_stages = {v} with pipeline.schedule = {name!r}: only "
            "interleaved-1f1b takes a number of stages per rank"
            + (" (zbv always holds 2)" if name == "zbv" else "")
            + "; leave virtual_stages at 1 or use interleaved-1f1b"
        )
    if name not in NEXT_SCHEDULE_NAMES:
        return
    if p.tp > 1:
        raise ConfigError(
            f"parallel.tp = {p.tp} with pipeline.schedule = {name!r}: tensor-parallel stages "
            "run with gpipe, 1f1b and pipedream only; use one of them, or tp = 1"
        )
    if pl.partition == "auto":
        raise ConfigError(
            f"pipeline.partition = 'auto' with pipeline.schedule = {name!r}: the profiled "
            "partition places one stage per rank; use 'uniform' or a list of "
            f"{num_pipeline_stages(job)} block counts (pp x stages per rank)"
        )
    if pl.pipedream_update != "step":
        raise ConfigError(
            f"pipeline.pipedream_update = {pl.pipedream_update!r} with pipeline.schedule = "
            f"{name!r}: weight stashing is PipeDream's; use schedule = 'pipedream', or leave "
            "pipedream_update unset"
        )
    build_staged(name, p.pp, pl.microbatches, virtual_stages=v)  # the generator's own errors


def check_pipeline_job(job: JobConfig) -> None:
    """Raise a one-line `ConfigError` for layouts a pipeline (``parallel.pp > 1``) cannot run."""
    p = job.parallel
    if p.pp < 2:
        return
    check_schedule_options(job)
    if p.tp > 1 and job.pipeline.schedule == "pipedream":
        raise ConfigError(
            f"parallel.tp = {p.tp} with pipeline.schedule = 'pipedream': weight stashing of "
            "tensor-parallel stages is not supported; use gpipe or 1f1b, or tp = 1"
        )
    if p.zero:
        check_zero_stages(job)
    if p.sync != "allreduce":
        raise ConfigError(
            f"parallel.sync = {p.sync!r} with parallel.pp = {p.pp}: pipeline replicas combine "
            "gradients by all-reduce only; use sync = 'allreduce'"
        )
    if p.grad_compression != "none":
        raise ConfigError(
            f"parallel.grad_compression = {p.grad_compression!r} with parallel.pp = {p.pp}: "
            "pipeline stages average their gradients over dp in full precision; use "
            "grad_compression = 'none', or pp = 1 for compressed data-parallel all-reduce"
        )
    if job.pipeline.schedule == "pipedream" and job.train.on_nonfinite == "skip":
        raise ConfigError(
            "train.on_nonfinite = 'skip' with pipeline.schedule = 'pipedream': PipeDream "
            "updates after every micro-batch, so a step cannot be skipped; use 'stop'"
        )


def check_zero_stages(job: JobConfig) -> None:
    """Raise a one-line `ConfigError` for what ZeRO inside stages (`pipeline.sharded`) does not
    offer: weight stashing, the zero-bubble schedules' split backward, tensor-parallel
    stages (`pipeline.schedule.zero_stages_problem`, which the planner's search reads too)."""
    p = job.parallel
    problem = zero_stages_problem(p.zero, job.pipeline.schedule, p.tp, p.pp)
    if problem is not None:
        raise ConfigError(problem)
