"""Strategy families: how the trainer builds a strategy and what pre-flight checks it needs.

Each strategy package (``parallel/``, ``pipeline/``, ``ps/``, later ``gossip/``...) describes
itself with one `StrategyFamily`: which jobs it runs, its pre-flight checks (no processes, on
the model built on the meta device) and its builder (inside a worker). The trainer keeps the
table of families and asks it for both, so it never reaches into a strategy's modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from polytrain.comm.init import DistContext
from polytrain.config.job import JobConfig
from polytrain.core.strategy import Strategy
from polytrain.data.datasets import Dataset
from polytrain.data.sampler import Batches
from polytrain.errors import ConfigError
from polytrain.models.base import BlockModel

__all__ = ["Builder", "Checks", "StrategyFamily", "family_for"]

# Inside a worker: the strategy of this rank (builds its mesh or groups, wraps the model).
Builder = Callable[[JobConfig, DistContext, BlockModel, Batches], Strategy]
# In the launching process: raise a one-line PolytrainError for what the family cannot run.
Checks = Callable[[JobConfig, BlockModel, Dataset], None]


@dataclass(frozen=True)
class StrategyFamily:
    """One family of strategies: which jobs it runs, its pre-flight checks, its builder."""

    name: str
    selects: Callable[[JobConfig], bool]
    checks: Checks
    build: Builder


def family_for(job: JobConfig, families: tuple[StrategyFamily, ...]) -> StrategyFamily:
    """The one family of ``families`` that runs ``job`` (their ``selects`` exclude each other)."""
    chosen = [f for f in families if f.selects(job)]
    if len(chosen) != 1:
        names = [f.name for f in chosen] or "none"
        raise ConfigError(
            f"parallel.sync = {job.parallel.sync!r}, parallel.pp = {job.parallel.pp}: "
            f"strategy families that run it: {names}; choose sync = 'allreduce' or 'ps'"
        )
    return chosen[0]
