"""The decentralized strategy family (``parallel.sync = "gossip"`` or ``"localsgd"``)."""

from __future__ import annotations

from polytrain.comm.init import DistContext
from polytrain.config.job import JobConfig
from polytrain.core.compile import apply_compile
from polytrain.core.registry import StrategyFamily
from polytrain.core.strategy import Strategy
from polytrain.data.datasets import Dataset
from polytrain.data.sampler import Batches
from polytrain.errors import ConfigError
from polytrain.gossip.asynchronous import AsyncGossipStrategy
from polytrain.gossip.checks import checkpoint_refusal
from polytrain.gossip.localsgd import LocalSGDStrategy
from polytrain.gossip.replica import ReplicaStrategy
from polytrain.gossip.strategy import GossipStrategy
from polytrain.models.base import BlockModel

__all__ = ["DECENTRALIZED"]


def _checks(job: JobConfig, model: BlockModel, dataset: Dataset) -> None:
    """Ranges and world-size rules are checked when the job is built
    (`polytrain.config.decentralized.check_decentralized`); here, what cannot be saved."""
    refusal = checkpoint_refusal(job)
    if job.checkpoint.dir and refusal:
        raise ConfigError(refusal)


def _tolerated(job: JobConfig) -> list[int]:
    """Asynchronous gossip survives any rank but 0 (which collects the final weights):
    [Note: no world collectives in async gossip] in gossip/asynchronous.py."""
    if job.parallel.sync == "gossip" and job.gossip.mode == "async":
        return list(range(1, job.world_size))
    return []


def _build(job: JobConfig, ctx: DistContext, model: BlockModel, batches: Batches) -> Strategy:
    """No mesh: every rank holds a full replica and talks to the ranks its graph names."""
    model = model.to(ctx.device)
    if job.train.compile:
        apply_compile(model)
    cls: type[ReplicaStrategy] = LocalSGDStrategy
    if job.parallel.sync == "gossip":
        cls = AsyncGossipStrategy if job.gossip.mode == "async" else GossipStrategy
    return cls(job, model, batches, ctx.device, ctx.rank, ctx.world_size)


DECENTRALIZED = StrategyFamily(
    name="decentralized",
    selects=lambda job: job.parallel.sync in ("gossip", "localsgd"),
    checks=_checks,
    build=_build,
    cost_model="polytrain.planner.cost.decentralized",
    sections=("gossip", "localsgd"),
    flags={
        "topology": "gossip.topology",
        "peers": "gossip.peers",
        "compress": "gossip.compress",
        "overlap": "gossip.overlap",
        "period": "localsgd.period",
    },
    tolerated_ranks=_tolerated,
    # [Note: DiLoCo state] in gossip/localsgd.py
    state_settings={"localsgd.outer": "DiLoCo's anchor and outer momentum"},
)
