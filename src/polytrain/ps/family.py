"""The parameter-server strategy family (``parallel.sync = "ps"``): checks and builder."""

from __future__ import annotations

from polytrain.comm.init import DistContext
from polytrain.config.job import JobConfig
from polytrain.core.registry import StrategyFamily
from polytrain.core.strategy import Strategy
from polytrain.data.datasets import Dataset
from polytrain.data.sampler import Batches
from polytrain.models.base import BlockModel
from polytrain.ps.checks import check_ps_job
from polytrain.ps.strategy import PSStrategy

__all__ = ["PARAMETER_SERVER"]


def _checks(job: JobConfig, model: BlockModel, dataset: Dataset) -> None:
    check_ps_job(job, model)


def _build(job: JobConfig, ctx: DistContext, model: BlockModel, batches: Batches) -> Strategy:
    """Dedicated server ranks (the last ``ps.servers``), no SPMD mesh."""
    return PSStrategy(job, ctx.rank, ctx.world_size, model, batches)


PARAMETER_SERVER = StrategyFamily(
    name="parameter-server",
    selects=lambda job: job.parallel.sync == "ps",
    checks=_checks,
    build=_build,
)
