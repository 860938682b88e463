"""The pipeline strategy family (``parallel.pp > 1``): pre-flight checks and builder."""

from __future__ import annotations

import torch

from polytrain.comm.init import DistContext
from polytrain.comm.mesh import Mesh, build_mesh
from polytrain.config.job import JobConfig
from polytrain.core.registry import StrategyFamily
from polytrain.core.strategy import Strategy
from polytrain.core.tensor_parallel import check_tp_plan
from polytrain.data.datasets import Dataset
from polytrain.data.sampler import Batches
from polytrain.errors import ConfigError, PartitionError
from polytrain.models.base import BlockModel
from polytrain.models.blocks import disable_inplace
from polytrain.models.split import counts_from_split_points
from polytrain.pipeline.checks import check_pipeline_job, num_pipeline_stages
from polytrain.pipeline.pipedream import PipeDreamStrategy
from polytrain.pipeline.profile import check_partition
from polytrain.pipeline.strategy import PipelineStrategy
from polytrain.topology import ParallelDims

__all__ = ["PIPELINE", "build_pipeline", "check_pipeline", "pipeline_strategy"]


def check_pipeline(job: JobConfig, model: BlockModel, dataset: Dataset) -> None:
    """Stages, partition, schedule options and the stages' tensor-parallel plan."""
    pp = job.parallel.pp
    num_stages = num_pipeline_stages(job)
    stages = f"{pp} x {num_stages // pp} = {num_stages}" if num_stages > pp else f"{pp}"
    if model.layers:
        _check_layer_pipeline(job, model, num_stages, stages)
    elif num_stages > model.num_blocks:
        raise PartitionError(
            f"parallel.pp = {stages} stages but the model has only {model.num_blocks} blocks: "
            f"use at most {model.num_blocks} stages or a deeper model"
        )
    check_pipeline_job(job)
    if not model.layers:  # a user model's layers are partitioned by the runtime
        check_partition(job, model, dataset)
    check_tp_plan(job, model)


def _check_layer_pipeline(job: JobConfig, model: BlockModel, num_stages: int, stages: str) -> None:
    """A pipeline over a user model's repeated layers ([Note: layer pipeline] in
    models.split): ``num_stages`` slices (``stages`` spells pp x stages per rank)."""
    p, pl = job.parallel, job.pipeline
    if num_stages > len(model.layers):
        raise ConfigError(
            f"parallel.pp = {stages} stages but the model has {len(model.layers)} repeated layers "
            f"({model.layers[0].rpartition('.')[0]!r}): use at most {len(model.layers)} stages"
            + (
                f" (fewer ranks, or stages per rank: {pl.schedule} holds {num_stages // p.pp})"
                if num_stages > p.pp
                else ""
            )
        )
    if pl.split_points:
        counts_from_split_points(model.blocks[0], model.layers, pl.split_points, num_stages)
    if p.zero and num_stages > p.pp:  # pipeline.sharded shards a rank's one model once
        raise ConfigError(
            f"parallel.zero = {p.zero} with pipeline.schedule = {pl.schedule!r} over the layers "
            f"of model.name = {job.model.name!r}: ZeRO shards one layer stage per rank, this "
            f"schedule holds {num_stages // p.pp}; use 1f1b or gpipe with ZeRO, or --zero 0"
        )


def build_pipeline(
    job: JobConfig, ctx: DistContext, model: BlockModel, batches: Batches
) -> Strategy:
    """The runtime owns its stages, recomputation and dp all-reduce (docs/pipeline.md)."""
    p = job.parallel
    dims = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp, world_size=ctx.world_size)
    mesh = build_mesh(dims, ctx.device.type)
    model = model.to(ctx.device)
    disable_inplace(model)  # [Note: in-place ops at boundaries] in models.blocks
    return pipeline_strategy(job, model, mesh, batches, ctx.device)


def pipeline_strategy(
    job: JobConfig, model: BlockModel, mesh: Mesh, batches: Batches, device: torch.device
) -> PipelineStrategy:
    """This rank's stage: PipeDream's stream, or a synchronous schedule's flushes."""
    cls = PipeDreamStrategy if job.pipeline.schedule == "pipedream" else PipelineStrategy
    return cls(job, model, mesh, batches, device)


PIPELINE = StrategyFamily(
    name="pipeline",
    selects=lambda job: job.parallel.sync != "ps" and job.parallel.pp > 1,
    checks=check_pipeline,
    build=build_pipeline,
    cost_model="polytrain.planner.cost.stages",
    sections=("pipeline",),
    flags={
        "schedule": "pipeline.schedule",
        "microbatches": "pipeline.microbatches",
        "virtual_stages": "pipeline.virtual_stages",
        "partition": "pipeline.partition",
        "memory_limit_mb": "pipeline.memory_limit_mb",
    },
)
