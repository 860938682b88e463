"""ParallelDims: validation, rank <-> coordinates, groups, readable names."""

from __future__ import annotations

import itertools

import pytest

from polytrain.errors import MeshError
from polytrain.topology import AXES, ParallelDims


def test_world_size_defaults_to_product() -> None:
    assert ParallelDims(dp=2, tp=2, pp=2).world_size == 8


def test_product_must_equal_world_size() -> None:
    with pytest.raises(MeshError, match=r"2 x 2 x 1 = 4 does not equal the world size 6"):
        ParallelDims(dp=2, tp=2, pp=1, world_size=6)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_degrees_must_be_positive_integers(bad: object) -> None:
    with pytest.raises(MeshError, match="parallel.tp"):
        ParallelDims(tp=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("dp", "tp", "pp"), list(itertools.product([1, 2, 3], repeat=3)))
def test_coords_round_trip(dp: int, tp: int, pp: int) -> None:
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    seen = set()
    for rank in range(dims.world_size):
        coords = dims.coords(rank)
        assert dims.rank_of(**coords) == rank
        seen.add(tuple(coords[a] for a in AXES))
    assert len(seen) == dims.world_size


def test_tp_is_innermost_so_tp_groups_are_consecutive_ranks() -> None:
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert dims.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.all_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.all_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_groups_partition_the_world() -> None:
    dims = ParallelDims(dp=3, tp=2, pp=2)
    for axis in AXES:
        groups = dims.all_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(12))
        assert all(len(g) == dims.degree(axis) for g in groups)


def test_readable_names() -> None:
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert str(dims) == "PP(2)-DP(2)-TP(2)"
    assert dims.describe(5) == "PP(1)-DP(0)-TP(1)-Rank(5)"


def test_unknown_axis_lists_valid_ones() -> None:
    with pytest.raises(MeshError, match="valid axes are pp, dp, tp"):
        ParallelDims().group_ranks("cp", 0)
    with pytest.raises(MeshError, match="outside"):
        ParallelDims(dp=2).coords(2)
