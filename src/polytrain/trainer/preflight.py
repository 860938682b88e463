"""Checks run in the launching process, before any worker starts (cheap, no collectives).

Everything a user can get wrong about a job and that can be known without running it is caught
here, so a mistake costs a one-line error instead of N crashed workers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from polytrain.config.job import JobConfig
from polytrain.data.datasets import build_datasets
from polytrain.errors import ConfigError, MeshError
from polytrain.models.base import BlockModel
from polytrain.models.registry import block_size_of, build_model
from polytrain.trainer.build import strategy_family

__all__ = ["preflight"]


def preflight(job: JobConfig) -> BlockModel:
    """Validate data, model and layout together; return the model built on the meta device.

    The checks common to every strategy are here; each strategy family's own come from the
    family table (`trainer.build.strategy_family`).
    """
    if job.checkpoint.save_final and Path(job.checkpoint.save_final).exists():
        raise ConfigError(
            f"--save-final {job.checkpoint.save_final!r} already exists: choose another path "
            "or remove the file"
        )
    family = strategy_family(job)
    train_data, _, spec = build_datasets(job.data, block_size_of(job.model))
    with torch.device("meta"):
        model = build_model(job.model, spec, job.train.seed)
    if job.launch.nnodes > 1 and job.launch.nproc % job.parallel.tp:
        raise MeshError(  # consecutive ranks share a host; tp groups are consecutive ranks
            f"parallel.tp = {job.parallel.tp} does not divide --nproc {job.launch.nproc}: "
            "tensor-parallel groups would straddle hosts; choose a tp that divides the "
            "processes per node"
        )
    family.checks(job, model, train_data)
    return model
