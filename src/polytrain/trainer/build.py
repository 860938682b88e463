"""Pick and build this rank's strategy from the table of strategy families.

Each strategy package describes itself with one `core.registry.StrategyFamily` (which jobs it
runs, its pre-flight checks, its builder); `trainer.preflight` asks the same table for the
checks. A new family (gossip, spatial) adds one row here and nothing else in the trainer.
"""

from __future__ import annotations

from polytrain.comm.init import DistContext
from polytrain.config.job import JobConfig
from polytrain.core.registry import StrategyFamily, family_for
from polytrain.core.strategy import Strategy
from polytrain.data.sampler import Batches
from polytrain.gossip.family import DECENTRALIZED
from polytrain.models.base import BlockModel
from polytrain.parallel.family import SPMD
from polytrain.pipeline.family import PIPELINE
from polytrain.ps.family import PARAMETER_SERVER

__all__ = ["FAMILIES", "build_strategy", "strategy_family"]

# Their ``selects`` exclude each other, so the order does not matter.
FAMILIES: tuple[StrategyFamily, ...] = (SPMD, PIPELINE, PARAMETER_SERVER, DECENTRALIZED)


def strategy_family(job: JobConfig) -> StrategyFamily:
    """The family that runs ``job``."""
    return family_for(job, FAMILIES)


def build_strategy(
    job: JobConfig, ctx: DistContext, model: BlockModel, batches: Batches
) -> Strategy:
    """This rank's strategy for ``job`` (collective: every rank calls it)."""
    return strategy_family(job).build(job, ctx, model, batches)
