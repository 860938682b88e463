"""The device mesh as a plain value: parallel degrees, axis names, rank <-> coordinates.

Pure Python (no torch), so the planner, the schedule generators and the CLI's pre-flight checks
use the same object the runtime does.

[Note: axis order] The mesh is laid out ``(pp, dp, tp)`` from the outermost axis to the
innermost, with ``tp`` varying fastest. Consecutive ranks therefore share a tensor-parallel group,
so when a launcher places consecutive local ranks on one host, ``tp`` stays inside a host (it
moves activations every layer) while ``dp`` and ``pp`` cross hosts (they move gradients once a
step, or one activation per micro-batch). This is the torchtitan / Megatron convention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from polytrain.errors import MeshError

__all__ = ["AXES", "ParallelDims"]

AXES: tuple[str, ...] = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data (``dp``), tensor (``tp``) and pipeline (``pp``) parallelism.

    ``world_size`` defaults to ``dp * tp * pp``; when given, the product must equal it.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = field(default=0)

    def __post_init__(self) -> None:
        for axis in AXES:
            degree = getattr(self, axis)
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise MeshError(f"parallel.{axis} = {degree!r}: expected a positive integer")
        product = self.dp * self.tp * self.pp
        if self.world_size == 0:
            object.__setattr__(self, "world_size", product)
        elif self.world_size != product:
            raise MeshError(
                f"dp x tp x pp = {self.dp} x {self.tp} x {self.pp} = {product} does not equal the "
                f"world size {self.world_size}: choose degrees whose product is {self.world_size}, "
                f"or launch {product} processes (--nproc {product})"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in `AXES` order."""
        return tuple(getattr(self, axis) for axis in AXES)

    def degree(self, axis: str) -> int:
        self._check_axis(axis)
        return int(getattr(self, axis))

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of ``rank``, e.g. ``{"pp": 1, "dp": 0, "tp": 1}``."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the world of {self.world_size} ranks")
        out: dict[str, int] = {}
        rest = rank
        for axis in reversed(AXES):
            size = getattr(self, axis)
            out[axis] = rest % size
            rest //= size
        return {axis: out[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        """Inverse of `coords`; missing axes default to 0."""
        for axis in coords:
            self._check_axis(axis)
        rank = 0
        for axis in AXES:
            size = getattr(self, axis)
            value = coords.get(axis, 0)
            if not 0 <= value < size:
                raise MeshError(f"{axis} coordinate {value} is outside 0..{size - 1}")
            rank = rank * size + value
        return rank

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks that share every coordinate with ``rank`` except along ``axis``."""
        self._check_axis(axis)
        coords = self.coords(rank)
        return [self.rank_of(**{**coords, axis: i}) for i in range(int(getattr(self, axis)))]

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``, each a list of ranks, in rank order of their first member."""
        seen: set[int] = set()
        groups: list[list[int]] = []
        for rank in range(self.world_size):
            if rank in seen:
                continue
            group = self.group_ranks(axis, rank)
            seen.update(group)
            groups.append(group)
        return groups

    def describe(self, rank: int | None = None) -> str:
        """Readable form: ``PP(2)-DP(2)-TP(2)``, or ``PP(1)-DP(0)-TP(1)-Rank(5)`` for one rank."""
        if rank is None:
            return "-".join(f"{axis.upper()}({getattr(self, axis)})" for axis in AXES)
        coords = self.coords(rank)
        return "-".join(f"{axis.upper()}({coords[axis]})" for axis in AXES) + f"-Rank({rank})"

    def __str__(self) -> str:
        return self.describe()

    def _check_axis(self, axis: str) -> None:
        if axis not in AXES:
            raise MeshError(f"unknown mesh axis {axis!r}: valid axes are {', '.join(AXES)}")
