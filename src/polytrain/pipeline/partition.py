"""Memory-aware pipeline partitioning: choose contiguous stage boundaries from block profiles.

PipeDream (Narayanan et al. SOSP 2019, section 3.1) profiles every layer once and then picks
stage boundaries by dynamic programming so that the slowest stage is as fast as possible; we do
the same for one worker per stage, adding the per-stage memory limit and the in-flight
activations of the chosen schedule (GPipe keeps ``m`` micro-batches, 1F1B ``min(m, p - s)``).
The search is pure Python (no torch), so the planner can reuse it; the torch half, measuring
the profiles and agreeing on the result across ranks, is `polytrain.pipeline.profile`.

See [Note: stage cost model] in `pipeline.stage_costs` for what a stage is predicted to cost.

[Note: ties] Many partitions often share the optimal bottleneck (the slowest stage is fixed and
the others can move). A second pass of the same DP picks, among the partitions whose stages all
stay within that bottleneck (and the memory limit), the one with the smallest sum of squared
stage times: the most even, which leaves the most slack for error in the profile.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

from polytrain.errors import PartitionError
from polytrain.pipeline.stage_costs import (
    MIB,
    BlockProfile,
    PartitionResult,
    StageCosts,
    block_ranges,
    check_stage_count,
    in_flight_microbatches,
    optimizer_state_factor,
)

__all__ = [
    "BlockProfile",
    "PartitionResult",
    "all_partitions",
    "block_ranges",
    "brute_force_partition",
    "check_counts",
    "evaluate_partition",
    "in_flight_microbatches",
    "nearby_partitions",
    "optimizer_state_factor",
    "search_partition",
    "uniform_counts",
]


def uniform_counts(num_blocks: int, num_stages: int) -> list[int]:
    """Blocks per stage as even as possible; the earlier stages take the remainder."""
    check_stage_count(num_blocks, num_stages)
    base, extra = divmod(num_blocks, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def check_counts(
    counts: Sequence[int], num_blocks: int, num_stages: int, *, stages_per_rank: int = 1
) -> list[int]:
    """Validate an explicit ``pipeline.partition`` list and return it as a list
    (``num_stages = parallel.pp * stages_per_rank``)."""
    check_stage_count(num_blocks, num_stages)
    counts = list(counts)
    if len(counts) != num_stages:
        pp = num_stages // stages_per_rank
        stages = f"{pp} x {stages_per_rank} stages per rank = {num_stages}"
        raise PartitionError(
            f"pipeline.partition = {counts} has {len(counts)} stage(s) but parallel.pp = "
            f"{stages if stages_per_rank > 1 else num_stages}: give one block count per stage"
        )
    if any(not isinstance(c, int) or c < 1 for c in counts):
        raise PartitionError(
            f"pipeline.partition = {counts}: every stage needs at least one block (a whole number)"
        )
    if sum(counts) != num_blocks:
        raise PartitionError(
            f"pipeline.partition = {counts} sums to {sum(counts)} but the model has "
            f"{num_blocks} blocks: give counts that sum to {num_blocks}"
        )
    return counts


def all_partitions(num_blocks: int, num_stages: int) -> Iterator[list[int]]:
    """Every way to cut ``num_blocks`` into ``num_stages`` non-empty contiguous stages."""
    check_stage_count(num_blocks, num_stages)
    for cuts in itertools.combinations(range(1, num_blocks), num_stages - 1):
        bounds = (0, *cuts, num_blocks)
        yield [bounds[s + 1] - bounds[s] for s in range(num_stages)]


def _min_max(
    num_blocks: int,
    num_stages: int,
    cost: Callable[[int, int, int], float],
    allowed: Callable[[int, int, int], bool],
    combine: Callable[[float, float], float] = max,
) -> list[int] | None:
    """Counts minimising ``max_s cost(s, a_s, b_s)`` over allowed stages; None if none fits.

    ``best[s][j]``: the smallest bottleneck of stages ``0..s-1`` covering blocks ``0..j-1``.
    O(num_blocks^2 x num_stages) evaluations of ``cost`` and ``allowed``. With ``combine`` a sum
    instead of ``max``, the same recursion minimises a total.
    """
    inf = float("inf")
    best = [[inf] * (num_blocks + 1) for _ in range(num_stages + 1)]
    cut = [[-1] * (num_blocks + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(num_stages):
        # stage s takes blocks [i, j); the stages after it need one block each at least
        for j in range(s + 1, num_blocks - (num_stages - 1 - s) + 1):
            for i in range(s, j):
                if best[s][i] == inf or not allowed(s, i, j):
                    continue
                value = combine(best[s][i], cost(s, i, j))
                if value < best[s + 1][j]:
                    best[s + 1][j], cut[s + 1][j] = value, i
    if best[num_stages][num_blocks] == inf:
        return None
    counts, j = [], num_blocks
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def search_partition(
    profiles: Sequence[BlockProfile],
    num_stages: int,
    *,
    schedule: str,
    num_microbatches: int,
    memory_limit_bytes: float | None,
    recompute: bool = False,
    recompute_every: int = 1,
    link_bytes_per_s: float | None = None,
    link_latency_s: float = 0.0,
    update_every: int = 1,
) -> PartitionResult:
    """The contiguous partition with the fastest slowest stage that fits the memory limit.

    Dynamic programming over (stages placed, blocks covered), O(n^2 p); see
    [Note: stage cost model]. ``update_every`` is the micro-batches per optimizer update of
    ``pipedream`` (``m`` for ``pipeline.pipedream_update = "step"``, 1 for ``"microbatch"``),
    which sets how many weight versions it stashes. Raises `PartitionError` naming the stage that cannot fit when no
    partition respects ``memory_limit_bytes`` (None: no limit).
    """
    costs = StageCosts(
        profiles,
        num_stages,
        schedule=schedule,
        num_microbatches=num_microbatches,
        recompute=recompute,
        recompute_every=recompute_every,
        link_bytes_per_s=link_bytes_per_s,
        link_latency_s=link_latency_s,
        update_every=update_every,
    )
    limit = memory_limit_bytes

    def fits(s: int, a: int, b: int) -> bool:
        return limit is None or costs.memory(s, a, b) <= limit

    counts = _min_max(len(profiles), num_stages, costs.time, fits)
    if counts is None:
        assert limit is not None
        _raise_infeasible(costs, len(profiles), num_stages, limit, recompute)
    assert counts is not None
    # [Note: ties] among the partitions with that bottleneck, the most even one
    bottleneck = max(costs.result(counts, limit).stage_time_s)

    def within(s: int, a: int, b: int) -> bool:
        return costs.time(s, a, b) <= bottleneck and fits(s, a, b)

    even = _min_max(
        len(profiles),
        num_stages,
        lambda s, a, b: costs.time(s, a, b) ** 2,
        within,
        combine=lambda x, y: x + y,
    )
    return costs.result(even or counts, limit)


def evaluate_partition(
    profiles: Sequence[BlockProfile],
    counts: Sequence[int],
    *,
    schedule: str,
    num_microbatches: int,
    memory_limit_bytes: float | None = None,
    recompute: bool = False,
    recompute_every: int = 1,
    link_bytes_per_s: float | None = None,
    link_latency_s: float = 0.0,
    update_every: int = 1,
) -> PartitionResult:
    """Predicted time and memory of a given partition (e.g. the uniform one)."""
    counts = check_counts(counts, len(profiles), len(counts))
    costs = StageCosts(
        profiles,
        len(counts),
        schedule=schedule,
        num_microbatches=num_microbatches,
        recompute=recompute,
        recompute_every=recompute_every,
        link_bytes_per_s=link_bytes_per_s,
        link_latency_s=link_latency_s,
        update_every=update_every,
    )
    return costs.result(counts, memory_limit_bytes)


def nearby_partitions(
    profiles: Sequence[BlockProfile],
    counts: Sequence[int],
    limit: int,
    *,
    radius: int = 2,
    schedule: str,
    num_microbatches: int,
    memory_limit_bytes: float | None = None,
    recompute: bool = False,
    recompute_every: int = 1,
    update_every: int = 1,
) -> list[list[int]]:
    """``counts`` and up to ``limit - 1`` partitions that move one of its stage boundaries by up
    to ``radius`` blocks, fastest predicted first, each within the memory limit.

    The candidates `choose_partition` times inside the pipeline ([Note: partition trials]): where
    the profile errs, the measured best is usually the optimum with one boundary shifted.
    """
    costs = StageCosts(
        profiles,
        len(counts),
        schedule=schedule,
        num_microbatches=num_microbatches,
        recompute=recompute,
        recompute_every=recompute_every,
        link_bytes_per_s=None,
        link_latency_s=0.0,
        update_every=update_every,
    )
    best = list(counts)
    scored: list[tuple[float, list[int]]] = []
    for boundary in range(len(best) - 1):  # each (boundary, shift) gives a distinct partition
        for shift in range(-radius, radius + 1):
            moved = list(best)
            moved[boundary] += shift
            moved[boundary + 1] -= shift
            if shift == 0 or min(moved) < 1:
                continue
            result = costs.result(moved, memory_limit_bytes)
            if result.fits:
                scored.append((result.predicted_step_s, moved))
    scored.sort(key=lambda item: item[0])
    return [best] + [moved for _, moved in scored[: max(limit - 1, 0)]]


def brute_force_partition(
    profiles: Sequence[BlockProfile],
    num_stages: int,
    *,
    schedule: str,
    num_microbatches: int,
    memory_limit_bytes: float | None,
    recompute: bool = False,
    recompute_every: int = 1,
    link_bytes_per_s: float | None = None,
    link_latency_s: float = 0.0,
    update_every: int = 1,
) -> PartitionResult | None:
    """The best partition by trying all ``C(n-1, p-1)`` of them (None if none fits); for checks."""
    best: PartitionResult | None = None
    for counts in all_partitions(len(profiles), num_stages):
        result = evaluate_partition(
            profiles,
            counts,
            schedule=schedule,
            num_microbatches=num_microbatches,
            memory_limit_bytes=memory_limit_bytes,
            recompute=recompute,
            recompute_every=recompute_every,
            link_bytes_per_s=link_bytes_per_s,
            link_latency_s=link_latency_s,
            update_every=update_every,
        )
        if not result.fits:
            continue
        if best is None or result.bottleneck_s < best.bottleneck_s:
            best = result
    return best


def _raise_infeasible(
    costs: StageCosts, num_blocks: int, num_stages: int, limit: float, recompute: bool
) -> None:
    """Name the stage that cannot fit: the worst stage of the least memory-hungry partition."""
    counts = _min_max(num_blocks, num_stages, costs.memory, lambda s, a, b: True)
    assert counts is not None
    result = costs.result(counts, limit)
    stage = max(range(num_stages), key=lambda s: result.stage_memory_bytes[s])
    first, stop = result.block_ranges()[stage]
    last = stop - 1
    fixes = "more pipeline stages (--pp)"
    if not recompute:
        fixes += ", --recompute"
    fixes += ", smaller micro-batches (more --microbatches) or a higher pipeline.memory_limit_mb"
    raise PartitionError(
        f"no {num_stages}-stage partition fits pipeline.memory_limit_mb = {limit / MIB:g} "
        f"({_size(limit)}): even the leanest ({counts}) needs "
        f"{_size(result.stage_memory_bytes[stage])} "
        f"on stage {stage} (blocks {first}-{last}); use {fixes}"
    )


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", MIB * 1024), ("MiB", MIB), ("KiB", 1024.0)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"
