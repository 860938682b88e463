"""The SPMD strategy family: how the trainer builds it and what pre-flight checks it needs.

Order (STYLE 3): tensor parallel -> activation recomputation -> compile -> data parallel or ZeRO.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from polytrain._torch_private import ddp_ignore
from polytrain.comm.compression import SentBytes
from polytrain.comm.init import DistContext
from polytrain.comm.mesh import build_mesh
from polytrain.comm.p2p import new_group_of
from polytrain.config.job import JobConfig
from polytrain.core.batchnorm import convert_batchnorm
from polytrain.core.compile import apply_compile
from polytrain.core.recompute import apply_recompute
from polytrain.core.registry import StrategyFamily
from polytrain.core.strategy import Strategy
from polytrain.core.tensor_parallel import apply_tensor_parallel, check_tp_plan
from polytrain.core.tp_plans import Style
from polytrain.data.datasets import Dataset
from polytrain.data.sampler import Batches
from polytrain.errors import PartitionError
from polytrain.models.base import BlockModel, one_input
from polytrain.models.blocks import disable_inplace
from polytrain.parallel.data_parallel import apply_data_parallel
from polytrain.parallel.hybrid import apply_hybrid, hybrid_ignored, resolve_hybrid_plan
from polytrain.parallel.replicate import apply_replicate
from polytrain.parallel.spatial import apply_spatial, check_spatial
from polytrain.parallel.spmd import SPMDStrategy
from polytrain.parallel.sufficient_factor import (
    apply_sufficient_factor,
    choose_layers,
    plain_linears,
)
from polytrain.parallel.zero import apply_zero
from polytrain.topology import ParallelDims

__all__ = ["SPMD", "build_spmd", "check_hybrid_plan", "check_spmd_job"]


def check_hybrid_plan(job: JobConfig, model: BlockModel) -> dict[str, Style]:
    """The hybrid plan's modules and styles (empty without one; checked on one rank too,
    where it is not applied)."""
    p = job.parallel
    if not p.hybrid:
        return {}
    return resolve_hybrid_plan(model, p.hybrid, p.dp, job.train.global_batch_size)


def check_spmd_job(job: JobConfig, model: BlockModel, dataset: Dataset) -> None:
    check_tp_plan(job, model)
    check_hybrid_plan(job, model)
    if job.parallel.spatial > 1:
        x, _ = dataset.get(torch.arange(1))
        shape = tuple(x.shape[1:]) if isinstance(x, torch.Tensor) else ()
        check_spatial(model, shape, job.parallel.spatial)
    counts = job.pipeline.partition
    if isinstance(counts, list) and counts != [model.num_blocks]:  # one stage holds the model
        raise PartitionError(
            f"pipeline.partition = {counts} with parallel.pp = 1: the one stage holds all "
            f"{model.num_blocks} blocks; leave pipeline.partition unset (or set parallel.pp)"
        )
    if job.parallel.sufficient_factor == "on" and not plain_linears(model):
        choose_layers([], "on")  # raises: nothing to exchange factors for


def build_spmd(job: JobConfig, ctx: DistContext, model: BlockModel, batches: Batches) -> Strategy:
    p = job.parallel
    dims = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp, world_size=ctx.world_size)
    mesh = build_mesh(dims, ctx.device.type)
    model = model.to(ctx.device)
    if p.tp > 1:  # [Note: in-place ops at boundaries] in models.blocks
        disable_inplace(model)
    name = f"dp{p.dp}"
    batch: Literal["replica", "gather", "whole"] = "replica"  # see SPMDStrategy.batch
    if p.dp > 1 and job.model.batchnorm == "global":  # [Note: BatchNorm parity]
        convert_batchnorm(model, mesh.group("dp"))
    wrapped: torch.nn.Module = model
    sent = SentBytes()  # what our compression hooks hand to c10d (the step's bytes_sent)
    if p.tp > 1:
        apply_tensor_parallel(model, mesh.sub("tp"), job.model.name, p.tp_plan)
        name = f"tp{p.tp}"
    if p.recompute:
        apply_recompute(model, p.recompute_policy)
    if job.train.compile:
        apply_compile(model)
    if p.zero:
        wrapped = apply_zero(model, mesh, p)  # type: ignore[assignment]  # FSDPModule is an nn.Module
        name = f"zero{p.zero}-dp{p.dp}" + (f"-tp{p.tp}" if p.tp > 1 else "")
    elif p.dp > 1 and p.tp > 1:
        wrapped = apply_replicate(model, mesh)  # type: ignore[assignment]  # an nn.Module
        name = f"replicate-dp{p.dp}-tp{p.tp}"
    elif p.spatial > 1:  # [Note: spatial gradient scale] in parallel.spatial
        halo = new_group_of([list(range(ctx.world_size))], ctx.rank)
        count = apply_spatial(model, halo, mesh.group("dp"), mesh.coord("dp"), p.spatial)
        wrapped = apply_data_parallel(model, mesh, p, sent)
        name = f"spatial{p.spatial}-conv{count}"
        batch = "whole"
    elif p.dp > 1 and p.hybrid:  # [Note: hybrid activation redistribution]
        assignment = check_hybrid_plan(job, model)
        ddp_ignore(model, hybrid_ignored(model, assignment))
        apply_hybrid(model, mesh, assignment)
        wrapped = apply_data_parallel(model, mesh, p, sent)
        name = f"hybrid-dp{p.dp}-mp{len(assignment)}"
        batch = "gather"
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
            wrapped = apply_data_parallel(model, mesh, p, sent)
    strategy = SPMDStrategy(job, wrapped, model, mesh, batches, ctx.device, name)
    strategy.batch = batch
    if p.grad_compression != "none" and isinstance(wrapped, DDP):
        strategy.sent = sent
    return strategy


SPMD = StrategyFamily(
    name="spmd",
    selects=lambda job: job.parallel.sync == "allreduce" and job.parallel.pp == 1,
    checks=check_spmd_job,
    build=build_spmd,
    cost_model="polytrain.planner.cost.spmd",
)
