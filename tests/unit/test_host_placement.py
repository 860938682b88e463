"""Topology-aware placement (issue 16): where the mesh's axes fall when node k holds the
consecutive global ranks ``k * nproc ...`` (the elastic launcher's assignment, with node ranks
kept by launch/multinode.py; see tests/integration/test_multihost.py for the launch itself)."""

from __future__ import annotations

import itertools

import pytest

from polytrain.topology import ParallelDims


def _hosts(ranks: list[int], per_host: int) -> set[int]:
    return {r // per_host for r in ranks}


@pytest.mark.parametrize(
    ("dp", "tp", "per_host"), [(2, 2, 2), (4, 2, 2), (2, 2, 4), (2, 4, 4), (4, 2, 4)]
)
def test_tensor_parallel_stays_inside_a_host_and_dp_crosses(
    dp: int, tp: int, per_host: int
) -> None:
    dims = ParallelDims(dp=dp, tp=tp)
    num_hosts = dims.world_size // per_host
    for group in dims.all_groups("tp"):
        assert len(_hosts(group, per_host)) == 1, group
    for group in dims.all_groups("dp"):
        # dp spreads over every host, with as few of its ranks per host as the shape allows
        assert len(_hosts(group, per_host)) == num_hosts, group


@pytest.mark.parametrize(("pp", "dp", "per_host"), [(2, 2, 2), (4, 2, 4), (4, 1, 2), (2, 2, 4)])
def test_pipeline_crosses_hosts_only_between_consecutive_stage_blocks(
    pp: int, dp: int, per_host: int
) -> None:
    """Each stage's replicas share a host, consecutive stages share a host where they fit, so
    exactly ``hosts - 1`` stage boundaries cross hosts (per pipeline)."""
    dims = ParallelDims(pp=pp, dp=dp)
    num_hosts = dims.world_size // per_host
    for group in dims.all_groups("dp"):
        assert len(_hosts(group, per_host)) == 1, group  # a stage's replicas stay together
    for pipe in dims.all_groups("pp"):
        hosts = [r // per_host for r in pipe]
        assert hosts == sorted(hosts)
        crossings = sum(a != b for a, b in itertools.pairwise(hosts))
        assert crossings == num_hosts - 1, pipe


def test_tp_pp_dp_hybrid_keeps_tp_in_host() -> None:
    dims = ParallelDims(pp=2, dp=2, tp=2)  # 8 ranks on 2 hosts of 4
    for group in dims.all_groups("tp"):
        assert len(_hosts(group, 4)) == 1
    for group in dims.all_groups("pp"):
        assert len(_hosts(group, 4)) == 2
