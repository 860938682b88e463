"""Which server holds which parameter, and which workers share a host (pure, no torch).

Parameters are spread over ``num_servers`` servers so that each stores and serves about the same
number of bytes (DistBelief's sharded parameter server, Dean et al., NIPS 2012; the key ranges
of Li et al., OSDI 2014, here at whole-parameter granularity). The split is the classic greedy
LPT rule: largest parameter first onto the currently lightest server, which is within 4/3 of the
optimal makespan (Graham 1969) and exact for many equal parameters.

Hierarchical parameter servers (Rudra, Gupta et al., "Model Accuracy and Runtime Tradeoff in
Distributed Deep Learning", ICDM 2016) first reduce gradients among the workers of one host and
let a single leader per host talk to the servers; `host_groups` and `leader_of` name them.

[Note: determinism] Every rank computes the plan locally, so it must not depend on anything but
its inputs: ties between equal sizes break by parameter name, ties between equally loaded
servers by server index, and each server lists its parameters in the caller's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from polytrain.errors import ConfigError

__all__ = ["ShardPlan", "host_groups", "leader_of", "plan_shards", "shard_parameters"]


@dataclass(frozen=True)
class ShardPlan:
    """Assignment of parameters to servers: ``assignment[s]`` lists the names server ``s`` holds."""

    assignment: tuple[tuple[str, ...], ...]
    server_bytes: tuple[int, ...]
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert len(self.assignment) == len(self.server_bytes)
        index = {name: s for s, names in enumerate(self.assignment) for name in names}
        object.__setattr__(self, "_index", index)

    @property
    def num_servers(self) -> int:
        return len(self.assignment)

    def server_of(self, name: str) -> int:
        """Index of the server holding parameter ``name``."""
        index = self._index
        if name not in index:
            raise ConfigError(
                f"parameter {name!r} is not in the shard plan ({len(index)} parameters): build "
                f"the plan from the same model on every rank"
            )
        return index[name]

    @property
    def imbalance(self) -> float:
        """Largest server's bytes over the mean (1.0 is perfect balance)."""
        total = sum(self.server_bytes)
        if total == 0:
            return 1.0
        return max(self.server_bytes) * len(self.server_bytes) / total


def plan_shards(params: Sequence[tuple[str, int]], num_servers: int) -> ShardPlan:
    """Balance ``(name, nbytes)`` parameters over ``num_servers`` servers by bytes (greedy LPT)."""
    _check_params(params, num_servers)
    loads = [0] * num_servers
    owner: dict[str, int] = {}
    for name, nbytes in sorted(params, key=lambda p: (-p[1], p[0])):
        lightest = min(range(num_servers), key=lambda s: (loads[s], s))
        owner[name] = lightest
        loads[lightest] += nbytes
    assignment = tuple(
        tuple(name for name, _ in params if owner[name] == s) for s in range(num_servers)
    )
    return ShardPlan(assignment=assignment, server_bytes=tuple(loads))


def shard_parameters(params: Sequence[tuple[str, int]], num_servers: int) -> list[list[str]]:
    """Parameter names per server, balanced by bytes; see `plan_shards`."""
    return [list(names) for names in plan_shards(params, num_servers).assignment]


def _check_params(params: Sequence[tuple[str, int]], num_servers: int) -> None:
    if not isinstance(num_servers, int) or isinstance(num_servers, bool) or num_servers < 1:
        raise ConfigError(f"ps.servers = {num_servers!r}: expected a positive integer")
    if num_servers > len(params):
        raise ConfigError(
            f"ps.servers = {num_servers} exceeds the {len(params)} parameters to shard: some "
            f"servers would hold nothing; set ps.servers <= {len(params)}"
        )
    seen: set[str] = set()
    for name, nbytes in params:
        if name in seen:
            raise ConfigError(f"parameter name {name!r} appears twice: names must be unique")
        seen.add(name)
        if nbytes < 0:
            raise ConfigError(f"parameter {name!r} has nbytes = {nbytes}: expected >= 0")


def host_groups(worker_ranks: Sequence[int], ranks_per_host: int) -> list[list[int]]:
    """Workers grouped by host, assuming host ``h`` runs ranks ``[h * r, (h + 1) * r)``.

    That is how the torch elastic agent numbers ranks (consecutive local ranks per node).
    Groups are ordered by host and ranks ascend within a group; hosts without a worker (for
    example a host running only servers) have no group.
    """
    if (
        not isinstance(ranks_per_host, int)
        or isinstance(ranks_per_host, bool)
        or ranks_per_host < 1
    ):
        raise ConfigError(
            f"ranks_per_host = {ranks_per_host!r}: expected a positive integer (--nproc per node)"
        )
    if len(set(worker_ranks)) != len(worker_ranks):
        raise ConfigError(f"worker ranks {list(worker_ranks)} contain duplicates")
    groups: dict[int, list[int]] = {}
    for rank in sorted(worker_ranks):
        if rank < 0:
            raise ConfigError(f"worker rank {rank}: expected a non-negative rank")
        groups.setdefault(rank // ranks_per_host, []).append(rank)
    return [groups[host] for host in sorted(groups)]


def leader_of(group: Sequence[int]) -> int:
    """The rank that talks to the servers for its host group: the lowest rank."""
    if not group:
        raise ConfigError("an empty host group has no leader: every group needs >= 1 worker")
    return min(group)
