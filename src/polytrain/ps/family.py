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
from polytrain.ps.leaf import leaf_groups, leaf_name, leaf_size
from polytrain.ps.strategy import PSStrategy

__all__ = ["PARAMETER_SERVER"]


def _checks(job: JobConfig, model: BlockModel, dataset: Dataset) -> None:
    check_ps_job(job, model)


def _tolerated(job: JobConfig) -> list[int]:
    """Asynchronous and bounded-stale workers other than rank 0 may die: rank 0 collects the
    final weights and the servers (the last ``ps.servers`` ranks) hold them. Sync and
    hierarchical PS steps are collectives over every worker; an async leaf's workers re-home to
    the root when it dies ([Note: re-homed groups] in ps/leaf.py) ([Note: tolerated worker deaths]
    in launch/tolerant.py)."""
    ps = job.ps
    if ps.mode not in ("async", "ssp") or ps.hierarchical:
        return []
    return list(range(1, job.world_size - ps.servers))


def _roles(job: JobConfig) -> dict[int, str]:
    """Leaf servers run on their group's lowest rank ([Note: leaf servers] in ps/leaf.py): its
    death ends a sync job, and the line naming it says which group lost its server."""
    per_leaf = leaf_size(job)
    if not per_leaf:
        return {}
    groups = leaf_groups(list(range(job.num_trainers)), per_leaf)
    return {
        g[0]: f"leaf server {leaf_name(i)} of worker ranks {g[0]}-{g[-1]}"
        for i, g in enumerate(groups)
    }


def _build(job: JobConfig, ctx: DistContext, model: BlockModel, batches: Batches) -> Strategy:
    """Dedicated server ranks (the last ``ps.servers``), no SPMD mesh."""
    return PSStrategy(job, ctx.rank, ctx.world_size, model, batches)


PARAMETER_SERVER = StrategyFamily(
    name="parameter-server",
    selects=lambda job: job.parallel.sync == "ps",
    checks=_checks,
    build=_build,
    cost_model="polytrain.planner.cost.ps",
    sections=("ps",),
    flags={
        "ps_servers": "ps.servers",
        "ps_mode": "ps.mode",
        "staleness": "ps.staleness",
        "ps_leaves": "ps.leaves",
    },
    tolerated_ranks=_tolerated,
    rank_roles=_roles,
)
