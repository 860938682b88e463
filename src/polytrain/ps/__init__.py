"""Parameter server: sharded servers, workers, and sync / async / bounded-staleness consistency.

Implements the sharded parameter server of DistBelief (Dean et al., NIPS 2012) and Li et al.
(OSDI 2014), stale synchronous parallel (Ho et al., NIPS 2013) and Rudra's hierarchical
aggregation (Gupta et al., ICDM 2016) over c10d point-to-point with tensor-only messages.

This package re-exports only its pure parts (`sharding`, `consistency`; no torch), so the planner
and the config checks can import them anywhere. The wire format needs torch: import it as
``polytrain.ps.protocol``.
"""

from polytrain.ps.consistency import (
    MODES,
    ApplyRule,
    ClockTable,
    Mode,
    StalenessViolation,
    SyncAggregator,
    apply_rule,
    check_consistency,
    check_staleness_trace,
    may_proceed,
    staleness_bound,
)
from polytrain.ps.sharding import ShardPlan, host_groups, leader_of, plan_shards, shard_parameters

__all__ = [
    "MODES",
    "ApplyRule",
    "ClockTable",
    "Mode",
    "ShardPlan",
    "StalenessViolation",
    "SyncAggregator",
    "apply_rule",
    "check_consistency",
    "check_staleness_trace",
    "host_groups",
    "leader_of",
    "may_proceed",
    "plan_shards",
    "shard_parameters",
    "staleness_bound",
]
