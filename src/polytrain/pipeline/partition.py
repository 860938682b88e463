"""Memory-aware pipeline partitioning: choose contiguous stage boundaries from block profiles.

PipeDream (Narayanan et al. SOSP 2019, section 3.1) profiles every layer once and then picks
stage boundaries by dynamic programming so that the slowest stage is as fast as possible; we do
the same for one worker per stage, adding the per-stage memory limit and the in-flight
activations of the chosen schedule (GPipe keeps ``m`` micro-batches, 1F1B ``min(m, p - s)``).
The search is pure Python (no torch), so the planner can reuse it; the torch half, measuring
the profiles and agreeing on the result across ranks, is `polytrain.pipeline.profile`.

[Note: stage cost model]
A stage ``s`` of ``p`` holding blocks ``a..b`` for ``m`` micro-batches is predicted to take
``t_s = sum(forward_s + backward_s) + sum(update_s) / m`` per micro-batch (``2 forward +
backward`` with recomputation; the optimizer update runs once per step, so each micro-batch
carries ``1 / m`` of it), plus ``2 x boundary_bytes / link_bytes_per_s + 2 x link_latency_s``
for each boundary it talks across (activation one way, its gradient back) when a link is given.
Its peak memory is::

    params + grads + optimizer state          (the stage's blocks)
    + in_flight(s) x activations              (one micro-batch's saved tensors + output)
    + stash_bound(s) x params                 (pipedream only: stashed weight versions)

where ``in_flight`` is the schedule's `peak_activations` (``m`` for gpipe, ``min(m, p - s)`` for
1f1b) and ``p - s`` for pipedream, whose micro-batch stream crosses step boundaries, and
``stash_bound = ceil((p - 1 - s) / u) + 1`` for an update every ``u`` micro-batches
(`schedule.stash_bound`, which sizes the runtime's stash too; an upper bound: it copies only
versions that a micro-batch in flight needs across an update, [Note: live forwards]; ``u = m``
for ``pipeline.pipedream_update = "step"``, ``p - s`` copies for ``u = 1``). The output
is the tensor sent downstream, held until its gradient comes back; the last stage's output is
the loss, whose saved tensors the last block's profile already includes. With recomputation
(`polytrain.parallel.recompute` checkpoints each block that has parameters) such a block keeps only
its input, and one block's activations are rebuilt at a time during backward (a transient
``max`` term). The received input is counted when the first block saves it. The search
minimises the largest ``t_s``, which sets a synchronous pipeline's step time
``sum(t) + (m - 1) x max(t)`` and an asynchronous pipeline's throughput.

[Note: ties] Many partitions often share the optimal bottleneck (the slowest stage is fixed and
the others can move). A second pass of the same DP picks, among the partitions whose stages all
stay within that bottleneck (and the memory limit), the one with the smallest sum of squared
stage times: the most even, which leaves the most slack for error in the profile.

The model ignores activation-gradient buffers and allocator slack, so a limit
should keep some headroom.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from polytrain.errors import PartitionError
from polytrain.pipeline.schedule import build, max_in_flight, peak_activations, stash_bound

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

_MIB = 1024.0 * 1024.0


@dataclass(frozen=True)
class BlockProfile:
    """What one block costs on one micro-batch (times in seconds, sizes in bytes)."""

    forward_s: float
    backward_s: float
    param_count: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """Saved-for-backward tensors of one micro-batch, storage de-duplicated, parameters excluded."""
    input_bytes: int
    output_bytes: int
    """The block's output: what crosses a stage boundary after it."""
    update_s: float = 0.0
    """One optimizer step over the block's parameters (once per step, not per micro-batch)."""


@dataclass(frozen=True)
class PartitionResult:
    """A partition and its predicted cost per stage ([Note: stage cost model])."""

    counts: list[int]
    stage_time_s: list[float]
    stage_memory_bytes: list[float]
    stage_params: list[int]
    schedule: str
    num_microbatches: int
    memory_limit_bytes: float | None = None

    @property
    def bottleneck_s(self) -> float:
        """The slowest stage's time per micro-batch."""
        return max(self.stage_time_s)

    @property
    def fits(self) -> bool:
        """Every stage's predicted peak memory is within the limit (or there is none)."""
        limit = self.memory_limit_bytes
        return limit is None or max(self.stage_memory_bytes) <= limit

    @property
    def predicted_step_s(self) -> float:
        """Fill-drain step estimate ``sum(t) + (m - 1) x max(t)`` for ``m`` micro-batches."""
        return sum(self.stage_time_s) + (self.num_microbatches - 1) * self.bottleneck_s

    def block_ranges(self) -> list[tuple[int, int]]:
        """Half-open ``[start, stop)`` block indices per stage (`block_ranges`)."""
        return block_ranges(self.counts)

    def table(self) -> str:
        """Plain-text table: one row per stage with blocks, parameters, time and peak memory."""
        limit = (
            f", limit {self.memory_limit_bytes / _MIB:.1f} MiB"
            if self.memory_limit_bytes is not None
            else ""
        )
        header = (
            f"pipeline partition {self.counts} ({self.schedule}, {self.num_microbatches} "
            f"micro-batches{limit}; predicted step {self.predicted_step_s * 1e3:.2f} ms)"
        )
        rows = [("stage", "blocks", "params", "time/mb (ms)", "peak mem (MiB)")]
        for s, (first, stop) in enumerate(self.block_ranges()):
            last = stop - 1
            rows.append(
                (
                    str(s),
                    f"{first}-{last}" if last > first else str(first),
                    f"{self.stage_params[s]:,}",
                    f"{self.stage_time_s[s] * 1e3:.3f}",
                    f"{self.stage_memory_bytes[s] / _MIB:.2f}",
                )
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines = [
            "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        return "\n".join([header, *lines])


def optimizer_state_factor(name: str, momentum: float = 0.0) -> int:
    """Optimizer-state bytes per parameter byte: AdamW 2, SGD with momentum 1, plain SGD 0."""
    if name == "adamw":
        return 2
    if name == "sgd":
        return 1 if momentum > 0 else 0
    raise PartitionError(f"optimizer {name!r}: expected 'adamw' or 'sgd'")


def block_ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Blocks per stage ``[n0, n1, ...]`` -> half-open ranges ``[(0, n0), (n0, n0 + n1), ...]``.

    The counts are assumed valid (`check_counts`, `uniform_counts` or the search made them).
    """
    bounds = list(itertools.accumulate(counts, initial=0))
    return list(itertools.pairwise(bounds))


def uniform_counts(num_blocks: int, num_stages: int) -> list[int]:
    """Blocks per stage as even as possible; the earlier stages take the remainder."""
    _check_stage_count(num_blocks, num_stages)
    base, extra = divmod(num_blocks, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def check_counts(counts: Sequence[int], num_blocks: int, num_stages: int) -> list[int]:
    """Validate an explicit ``pipeline.partition`` list and return it as a list."""
    _check_stage_count(num_blocks, num_stages)
    counts = list(counts)
    if len(counts) != num_stages:
        raise PartitionError(
            f"pipeline.partition = {counts} has {len(counts)} stage(s) but parallel.pp = "
            f"{num_stages}: give one block count per stage"
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


def in_flight_microbatches(schedule: str, num_stages: int, num_microbatches: int) -> list[int]:
    """Micro-batches whose activations a stage holds at once, per stage, under ``schedule``."""
    if schedule == "pipedream":
        build(schedule, num_stages, num_microbatches)  # validates the sizes
        return [max_in_flight(s, num_stages) for s in range(num_stages)]
    peaks = peak_activations(build(schedule, num_stages, num_microbatches))
    return [peaks[s] for s in range(num_stages)]


def all_partitions(num_blocks: int, num_stages: int) -> Iterator[list[int]]:
    """Every way to cut ``num_blocks`` into ``num_stages`` non-empty contiguous stages."""
    _check_stage_count(num_blocks, num_stages)
    for cuts in itertools.combinations(range(1, num_blocks), num_stages - 1):
        bounds = (0, *cuts, num_blocks)
        yield [bounds[s + 1] - bounds[s] for s in range(num_stages)]


class _Costs:
    """Prefix sums over the profiles: O(1) time and memory of any stage ``[a, b)``."""

    def __init__(
        self,
        profiles: Sequence[BlockProfile],
        num_stages: int,
        *,
        schedule: str,
        num_microbatches: int,
        recompute: bool,
        link_bytes_per_s: float | None,
        link_latency_s: float,
        update_every: int,
    ) -> None:
        self.profiles = list(profiles)
        self.num_stages = num_stages
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.recompute = recompute
        self.link_bytes_per_s = link_bytes_per_s
        self.link_latency_s = link_latency_s
        self.in_flight = in_flight_microbatches(schedule, num_stages, num_microbatches)
        self.stash = [
            stash_bound(s, num_stages, update_every) if schedule == "pipedream" else 0
            for s in range(num_stages)
        ]
        forward_factor = 2.0 if recompute else 1.0

        def prefix(values: Iterator[float]) -> list[float]:
            return list(itertools.accumulate(values, initial=0.0))

        self._time = prefix(
            forward_factor * b.forward_s + b.backward_s + b.update_s / num_microbatches
            for b in profiles
        )
        self._params = prefix(float(b.param_count) for b in profiles)
        self._param_bytes = prefix(float(b.param_bytes) for b in profiles)
        self._state = prefix(
            float(b.param_bytes + b.grad_bytes + b.optimizer_bytes) for b in profiles
        )
        self._act = prefix(float(b.activation_bytes) for b in profiles)
        # recomputation wraps blocks with parameters: they keep only their input
        self._kept = prefix(
            float(b.input_bytes if b.param_count else b.activation_bytes) for b in profiles
        )
        # and rebuild one block's activations at a time: the largest over [a, b), precomputed
        n = len(self.profiles)
        self._rebuilt = [[0.0] * (n + 1) for _ in range(n + 1)] if recompute else []
        for a in range(n if recompute else 0):
            largest = 0.0
            for b in range(a + 1, n + 1):
                block = self.profiles[b - 1]
                if block.param_count:
                    largest = max(largest, float(block.activation_bytes))
                self._rebuilt[a][b] = largest

    def time(self, stage: int, a: int, b: int) -> float:
        t = self._time[b] - self._time[a]
        if self.link_bytes_per_s:
            for boundary in self._boundaries(stage, a, b):
                t += 2.0 * (boundary / self.link_bytes_per_s + self.link_latency_s)
        return t

    def _boundaries(self, stage: int, a: int, b: int) -> list[int]:
        out = []
        if stage > 0:
            out.append(self.profiles[a].input_bytes)
        if stage < self.num_stages - 1:
            out.append(self.profiles[b - 1].output_bytes)
        return out

    def memory(self, stage: int, a: int, b: int) -> float:
        live = self.in_flight[stage]
        # the output waits for its gradient; the last stage's output is the loss
        output = self.profiles[b - 1].output_bytes if stage < self.num_stages - 1 else 0
        transient = 0.0
        if self.recompute:
            per_mb = self._kept[b] - self._kept[a] + output
            transient = self._rebuilt[a][b]
        else:
            per_mb = self._act[b] - self._act[a] + output
        memory = self._state[b] - self._state[a] + live * per_mb + transient
        return memory + self.stash[stage] * (self._param_bytes[b] - self._param_bytes[a])

    def params(self, a: int, b: int) -> int:
        return int(self._params[b] - self._params[a])

    def result(self, counts: Sequence[int], memory_limit_bytes: float | None) -> PartitionResult:
        bounds = list(itertools.accumulate(counts, initial=0))
        ranges = [(s, bounds[s], bounds[s + 1]) for s in range(len(counts))]
        return PartitionResult(
            counts=list(counts),
            stage_time_s=[self.time(s, a, b) for s, a, b in ranges],
            stage_memory_bytes=[self.memory(s, a, b) for s, a, b in ranges],
            stage_params=[self.params(a, b) for _, a, b in ranges],
            schedule=self.schedule,
            num_microbatches=self.num_microbatches,
            memory_limit_bytes=memory_limit_bytes,
        )


def _costs(
    profiles: Sequence[BlockProfile],
    num_stages: int,
    schedule: str,
    num_microbatches: int,
    recompute: bool,
    link_bytes_per_s: float | None,
    link_latency_s: float,
    update_every: int,
) -> _Costs:
    _check_stage_count(len(profiles), num_stages)
    if update_every < 1:
        raise PartitionError(f"update_every = {update_every}: expected at least 1 micro-batch")
    return _Costs(
        profiles,
        num_stages,
        schedule=schedule,
        num_microbatches=num_microbatches,
        recompute=recompute,
        link_bytes_per_s=link_bytes_per_s,
        link_latency_s=link_latency_s,
        update_every=update_every,
    )


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
    costs = _costs(
        profiles,
        num_stages,
        schedule,
        num_microbatches,
        recompute,
        link_bytes_per_s,
        link_latency_s,
        update_every,
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
    link_bytes_per_s: float | None = None,
    link_latency_s: float = 0.0,
    update_every: int = 1,
) -> PartitionResult:
    """Predicted time and memory of a given partition (e.g. the uniform one)."""
    counts = check_counts(counts, len(profiles), len(counts))
    costs = _costs(
        profiles,
        len(counts),
        schedule,
        num_microbatches,
        recompute,
        link_bytes_per_s,
        link_latency_s,
        update_every,
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
    update_every: int = 1,
) -> list[list[int]]:
    """``counts`` and up to ``limit - 1`` partitions that move one of its stage boundaries by up
    to ``radius`` blocks, fastest predicted first, each within the memory limit.

    The candidates `choose_partition` times inside the pipeline ([Note: partition trials]): where
    the profile errs, the measured best is usually the optimum with one boundary shifted.
    """
    costs = _costs(
        profiles, len(counts), schedule, num_microbatches, recompute, None, 0.0, update_every
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
    costs: _Costs, num_blocks: int, num_stages: int, limit: float, recompute: bool
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
        f"no {num_stages}-stage partition fits pipeline.memory_limit_mb = {limit / _MIB:g} "
        f"({_size(limit)}): even the leanest ({counts}) needs "
        f"{_size(result.stage_memory_bytes[stage])} "
        f"on stage {stage} (blocks {first}-{last}); use {fixes}"
    )


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", _MIB * 1024), ("MiB", _MIB), ("KiB", 1024.0)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def _check_stage_count(num_blocks: int, num_stages: int) -> None:
    if num_stages < 1:
        raise PartitionError(f"parallel.pp = {num_stages}: expected at least one stage")
    if num_stages > num_blocks:
        raise PartitionError(
            f"parallel.pp = {num_stages} stages but the model has only {num_blocks} blocks: "
            f"use at most {num_blocks} stages or a deeper model"
        )
