"""Planner: predicts step time, memory and cost of a layout before launch (pure, no torch).

Typical use::

    from polytrain.planner import PlanRequest, parse_cluster, search
    from polytrain.planner.stats_pure import gpt_stats

    stats = gpt_stats(n_layer=8, n_embd=512, n_head=8, block_size=256, vocab_size=96)
    result = search(PlanRequest(stats, parse_cluster("4x8xH100:ib400"), 32, 1200, budget=20))
    result.best.layout.overrides()          # JobConfig fields of the chosen layout

Derivations: docs/planner.md. Nothing in this package imports torch or a strategy package's
runtime; the numbers it reads (``ModelStats``, ``HostProfile``) are measured by
``polytrain.measure``, which it never imports.
"""

from polytrain.planner.cluster import Cluster, load_cluster, parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.memory import MemoryEstimate, memory_per_rank
from polytrain.planner.search import Plan, PlanRequest, PlanResult, search
from polytrain.planner.types import BlockStats, Curve, HostProfile, Layout, ModelStats, Prediction

__all__ = [
    "BlockStats",
    "Cluster",
    "Curve",
    "Env",
    "HostProfile",
    "Layout",
    "MemoryEstimate",
    "ModelStats",
    "Plan",
    "PlanRequest",
    "PlanResult",
    "Prediction",
    "load_cluster",
    "memory_per_rank",
    "parse_cluster",
    "predict",
    "search",
]
