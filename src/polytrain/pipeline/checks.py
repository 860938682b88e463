"""Pipeline job checks that need no processes: combinations the runtime does not offer."""

from __future__ import annotations

from polytrain.config.job import JobConfig
from polytrain.errors import ConfigError

__all__ = ["check_pipeline_job"]


def check_pipeline_job(job: JobConfig) -> None:
    """Raise a one-line `ConfigError` for layouts a pipeline (``parallel.pp > 1``) cannot run."""
    p = job.parallel
    if p.pp < 2:
        return
    if p.tp > 1 and job.pipeline.schedule == "pipedream":
        raise ConfigError(
            f"parallel.tp = {p.tp} with pipeline.schedule = 'pipedream': weight stashing of "
            "tensor-parallel stages is not supported; use gpipe or 1f1b, or tp = 1"
        )
    if p.zero:
        raise ConfigError(
            f"parallel.zero = {p.zero} with parallel.pp = {p.pp}: ZeRO sharding of pipeline "
            "stages is not supported; use zero = 0 (stages replicate over dp)"
        )
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
