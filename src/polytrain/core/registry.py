"""Strategy families: one registry row declares a family's whole surface.

Each strategy package (``parallel/``, ``pipeline/``, ``ps/``, ``gossip/``) describes itself with
one `StrategyFamily`: which jobs it runs, its pre-flight checks (no processes, on the model
built on the meta device), its builder (inside a worker), its own command-line flags (views of
its config sections' fields), which ranks may die without ending the job, what a rank serves
besides training (named when it fails), the settings its saved state depends on, and the
pure module under ``planner/cost/`` that prices it. The trainer keeps the table of families
(`trainer.build.FAMILIES`); the CLI, the launcher's caller and the planner's tests read it, so
none of them names a family. Adding a family is one package plus one row in that table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from polytrain.comm.init import DistContext
from polytrain.config.job import JobConfig
from polytrain.core.strategy import Strategy
from polytrain.data.datasets import Dataset
from polytrain.data.sampler import Batches
from polytrain.errors import ConfigError
from polytrain.models.base import BlockModel

__all__ = ["Builder", "Checks", "StrategyFamily", "family_for", "no_rank_may_die", "no_roles"]

# Inside a worker: the strategy of this rank (builds its mesh or groups, wraps the model).
Builder = Callable[[JobConfig, DistContext, BlockModel, Batches], Strategy]
# In the launching process: raise a one-line PolytrainError for what the family cannot run.
Checks = Callable[[JobConfig, BlockModel, Dataset], None]
# In the launching process: the ranks whose death the job survives ([Note: tolerated worker
# deaths] in launch/tolerant.py); every other rank's death ends the job in one line.
ToleratedRanks = Callable[[JobConfig], list[int]]
# In the launching process: what a rank does besides training, where that is worth naming when
# it fails (a leaf server on a worker's rank); the launcher's failure line carries it.
RankRoles = Callable[[JobConfig], dict[int, str]]


def no_rank_may_die(job: JobConfig) -> list[int]:
    """Synchronous families: every step is a collective, so every rank is needed."""
    return []


def no_roles(job: JobConfig) -> dict[int, str]:
    """Every rank only trains (or its family names it in its own errors)."""
    return {}


@dataclass(frozen=True)
class StrategyFamily:
    """One family of strategies and everything outside its package that needs to know it.

    ``flags`` maps a ``polytrain train`` option name to a field of the family's own config
    sections (``sections``); the option's help is that field's. ``cost_model`` names the pure
    module under ``polytrain.planner.cost`` whose formulas price the family's step (the planner
    never imports a family; tests/unit/test_families.py checks both ends agree).
    ``state_settings`` maps a dotted config key to the state the family saves, beyond the model
    and its optimizer, that depends on it (DiLoCo's anchor and outer momentum on
    ``localsgd.outer``): a resume that changes one is refused (trainer/resume_checks.py)."""

    name: str
    selects: Callable[[JobConfig], bool]
    checks: Checks
    build: Builder
    cost_model: str
    sections: tuple[str, ...] = ()
    flags: Mapping[str, str] = field(default_factory=dict)
    tolerated_ranks: ToleratedRanks = no_rank_may_die
    rank_roles: RankRoles = no_roles
    state_settings: Mapping[str, str] = field(default_factory=dict)


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
