"""Compose a strategy for a job: mesh -> model -> strategy, in one documented order.

Order (STYLE 3): tensor parallel -> activation recomputation -> data parallel or ZeRO. Pipeline
and parameter-server jobs have their own runtimes and are dispatched to them here.
"""

from __future__ import annotations

import torch

from polytrain.comm.init import DistContext
from polytrain.comm.mesh import build_mesh
from polytrain.config.job import JobConfig
from polytrain.data.sampler import Batches
from polytrain.models.base import BlockModel, one_input
from polytrain.models.blocks import disable_inplace
from polytrain.parallel.batchnorm import convert_batchnorm
from polytrain.parallel.data_parallel import apply_data_parallel
from polytrain.parallel.recompute import apply_recompute
from polytrain.parallel.replicate import apply_replicate
from polytrain.parallel.sufficient_factor import apply_sufficient_factor
from polytrain.parallel.tensor_parallel import apply_tensor_parallel
from polytrain.parallel.zero import apply_zero
from polytrain.topology import ParallelDims
from polytrain.trainer.strategy import SPMDStrategy, Strategy

__all__ = ["build_strategy"]


def build_strategy(
    job: JobConfig, ctx: DistContext, model: BlockModel, batches: Batches
) -> Strategy:
    p = job.parallel
    if p.sync == "ps":  # dedicated server ranks, no SPMD mesh (polytrain.ps.strategy)
        from polytrain.ps.strategy import PSStrategy

        return PSStrategy(job, ctx.rank, ctx.world_size, model, batches)
    dims = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp, world_size=ctx.world_size)
    mesh = build_mesh(dims, ctx.device.type)
    model = model.to(ctx.device)
    if p.pp > 1 or p.tp > 1:  # [Note: in-place ops at boundaries] in models.blocks
        disable_inplace(model)
    if p.pp > 1:  # the pipeline runtime owns its stages, recomputation and dp all-reduce
        from polytrain.pipeline.strategy import PipelineStrategy

        return PipelineStrategy(job, model, mesh, batches, ctx.device)
    name = f"dp{p.dp}"
    if p.dp > 1 and job.model.batchnorm == "global":  # [Note: BatchNorm parity]
        convert_batchnorm(model, mesh.group("dp"))
    wrapped: torch.nn.Module = model
    if p.tp > 1:
        apply_tensor_parallel(model, mesh.sub("tp"), job.model.name, p.tp_plan)
        name = f"tp{p.tp}"
    if p.recompute:
        apply_recompute(model)
    if p.zero:
        wrapped = apply_zero(model, mesh, p)  # type: ignore[assignment]  # FSDPModule is an nn.Module
        name = f"zero{p.zero}-dp{p.dp}" + (f"-tp{p.tp}" if p.tp > 1 else "")
    elif p.dp > 1 and p.tp > 1:
        wrapped = apply_replicate(model, mesh)  # type: ignore[assignment]  # an nn.Module
        name = f"replicate-dp{p.dp}-tp{p.tp}"
    elif p.dp > 1:
        name = f"ddp-dp{p.dp}"
        rest = True
        if p.sufficient_factor != "off":  # before DDP: it hides the chosen layers from DDP
            sample, _ = batches.train(0, mesh.coord("dp"), p.dp)
            local_batch = job.train.global_batch_size // (p.dp * job.train.grad_accum)
            sf = apply_sufficient_factor(
                model, mesh, p.sufficient_factor, one_input(sample).to(ctx.device), local_batch
            )
            name += f"-sf{len(sf.chosen)}"
            rest = bool(sf.allreduce_params)
        if rest:
            wrapped = apply_data_parallel(model, mesh, p)
    return SPMDStrategy(job, wrapped, model, mesh, batches, ctx.device, name)
