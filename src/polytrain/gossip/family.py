"""The decentralized strategy family (``parallel.sync = "gossip"`` or ``"localsgd"``)."""

from __future__ import annotations

from polytrain.comm.init import DistContext
from polytrain.config.job import JobConfig
from polytrain.core.registry import StrategyFamily
from polytrain.core.strategy import Strategy
from polytrain.data.datasets import Dataset
from polytrain.data.sampler import Batches
from polytrain.gossip.localsgd import LocalSGDStrategy
from polytrain.gossip.strategy import GossipStrategy
from polytrain.models.base import BlockModel

__all__ = ["DECENTRALIZED"]


def _checks(job: JobConfig, model: BlockModel, dataset: Dataset) -> None:
    """Everything a decentralized job can get wrong is known from its config alone
    (`polytrain.config.decentralized.check_decentralized`, run when the job is built)."""


def _build(job: JobConfig, ctx: DistContext, model: BlockModel, batches: Batches) -> Strategy:
    """No mesh: every rank holds a full replica and talks to the ranks its graph names."""
    model = model.to(ctx.device)
    cls = GossipStrategy if job.parallel.sync == "gossip" else LocalSGDStrategy
    return cls(job, model, batches, ctx.device, ctx.rank, ctx.world_size)


DECENTRALIZED = StrategyFamily(
    name="decentralized",
    selects=lambda job: job.parallel.sync in ("gossip", "localsgd"),
    checks=_checks,
    build=_build,
)
