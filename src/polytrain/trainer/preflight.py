"""Checks run in the launching process, before any worker starts (cheap, no collectives).

Everything a user can get wrong about a job and that can be known without running it is caught
here, so a mistake costs a one-line error instead of N crashed workers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from polytrain.config.job import JobConfig
from polytrain.data.datasets import build_datasets
from polytrain.errors import ConfigError, MeshError, PartitionError
from polytrain.models.base import BlockModel
from polytrain.models.blocks import disable_inplace
from polytrain.models.checks import check_model
from polytrain.models.registry import block_size_of, build_model
from polytrain.parallel.sufficient_factor import choose_layers, plain_linears
from polytrain.parallel.tensor_parallel import resolve_tp_plan
from polytrain.pipeline.checks import check_pipeline_job
from polytrain.pipeline.profile import check_partition
from polytrain.ps.checks import check_ps_job

__all__ = ["preflight"]


def preflight(job: JobConfig) -> BlockModel:
    """Validate data, model and layout together; return the model built on the meta device."""
    if job.checkpoint.save_final and Path(job.checkpoint.save_final).exists():
        raise ConfigError(
            f"--save-final {job.checkpoint.save_final!r} already exists: choose another path "
            "or remove the file"
        )
    train_data, _, spec = build_datasets(job.data, block_size_of(job.model))
    with torch.device("meta"):
        model = build_model(job.model, spec, job.train.seed)
    if job.parallel.pp > 1 or job.parallel.tp > 1:  # as the workers do (trainer/build.py)
        disable_inplace(model)
    check_model(job, model, train_data.get(torch.arange(min(2, len(train_data)))))
    if job.parallel.pp > model.num_blocks and not model.layers:
        raise PartitionError(
            f"parallel.pp = {job.parallel.pp} stages but the model has only {model.num_blocks} "
            f"blocks: use at most {model.num_blocks} stages or a deeper model"
        )
    if not model.layers:  # a user model's layers are partitioned in models.checks
        check_partition(job, model, train_data)
    check_pipeline_job(job)
    if job.parallel.tp > 1:  # heads, widths and vocabulary divisible; every plan row matches
        resolve_tp_plan(job.model.name, model, job.parallel.tp, job.parallel.tp_plan)
    if job.launch.nnodes > 1 and job.launch.nproc % job.parallel.tp:
        raise MeshError(  # consecutive ranks share a host; tp groups are consecutive ranks
            f"parallel.tp = {job.parallel.tp} does not divide --nproc {job.launch.nproc}: "
            "tensor-parallel groups would straddle hosts; choose a tp that divides the "
            "processes per node"
        )
    if job.parallel.sufficient_factor == "on" and not plain_linears(model):
        choose_layers([], "on")  # raises: nothing to exchange factors for
    if job.parallel.sync == "ps":
        check_ps_job(job, model)
    return model
