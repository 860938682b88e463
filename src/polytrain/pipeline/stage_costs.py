"""What a pipeline stage costs: time per micro-batch and peak memory, from block profiles.

The pure half of PipeDream's partitioner (Narayanan et al. SOSP 2019, section 3.1): the search
over stage boundaries (`pipeline.partition`) and the planner price stages with these formulas;
the profiles come from `pipeline.profile` (blocks) or `pipeline.layer_profile` (a user model's
layers). No torch.

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
(`polytrain.core.recompute` checkpoints each block that has parameters) such a block keeps only
its input, and one block's activations are rebuilt at a time during backward (a transient
``max`` term). The received input is counted when the first block saves it. The search
minimises the largest ``t_s``, which sets a synchronous pipeline's step time
``sum(t) + (m - 1) x max(t)`` and an asynchronous pipeline's throughput. The model ignores
activation-gradient buffers and allocator slack, so a memory limit should keep some headroom.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from polytrain.errors import PartitionError
from polytrain.pipeline.schedule import build, max_in_flight, peak_activations, stash_bound

__all__ = [
    "MIB",
    "BlockProfile",
    "PartitionResult",
    "StageCosts",
    "block_ranges",
    "check_stage_count",
    "in_flight_microbatches",
    "optimizer_state_factor",
]

MIB = 1024.0 * 1024.0


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
            f", limit {self.memory_limit_bytes / MIB:.1f} MiB"
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
                    f"{self.stage_memory_bytes[s] / MIB:.2f}",
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


def in_flight_microbatches(schedule: str, num_stages: int, num_microbatches: int) -> list[int]:
    """Micro-batches whose activations a stage holds at once, per stage, under ``schedule``."""
    if schedule == "pipedream":
        build(schedule, num_stages, num_microbatches)  # validates the sizes
        return [max_in_flight(s, num_stages) for s in range(num_stages)]
    peaks = peak_activations(build(schedule, num_stages, num_microbatches))
    return [peaks[s] for s in range(num_stages)]


class StageCosts:
    """Prefix sums over the profiles: O(1) time and memory of any stage ``[a, b)``."""

    def __init__(
        self,
        profiles: Sequence[BlockProfile],
        num_stages: int,
        *,
        schedule: str,
        num_microbatches: int,
        recompute: bool,
        recompute_every: int = 1,
        link_bytes_per_s: float | None,
        link_latency_s: float,
        update_every: int,
    ) -> None:
        check_stage_count(len(profiles), num_stages)
        if update_every < 1:
            raise PartitionError(f"update_every = {update_every}: expected at least 1 micro-batch")
        self.profiles = list(profiles)
        self.num_stages = num_stages
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.recompute = recompute
        # which blocks are recomputed (`parallel.recompute = "every:K"`: every K-th of the model)
        covered = [recompute and k % recompute_every == 0 for k in range(len(profiles))]
        self.link_bytes_per_s = link_bytes_per_s
        self.link_latency_s = link_latency_s
        self.in_flight = in_flight_microbatches(schedule, num_stages, num_microbatches)
        self.stash = [
            stash_bound(s, num_stages, update_every) if schedule == "pipedream" else 0
            for s in range(num_stages)
        ]

        def prefix(values: Iterator[float]) -> list[float]:
            return list(itertools.accumulate(values, initial=0.0))

        self._time = prefix(
            (2.0 if rec else 1.0) * b.forward_s + b.backward_s + b.update_s / num_microbatches
            for b, rec in zip(profiles, covered, strict=True)
        )
        self._params = prefix(float(b.param_count) for b in profiles)
        self._param_bytes = prefix(float(b.param_bytes) for b in profiles)
        self._state = prefix(
            float(b.param_bytes + b.grad_bytes + b.optimizer_bytes) for b in profiles
        )
        self._act = prefix(float(b.activation_bytes) for b in profiles)
        # recomputation wraps blocks with parameters: they keep only their input
        self._kept = prefix(
            float(b.input_bytes if b.param_count and rec else b.activation_bytes)
            for b, rec in zip(profiles, covered, strict=True)
        )
        # and rebuild one block's activations at a time: the largest over [a, b), precomputed
        n = len(self.profiles)
        self._rebuilt = [[0.0] * (n + 1) for _ in range(n + 1)] if recompute else []
        for a in range(n if recompute else 0):
            largest = 0.0
            for b in range(a + 1, n + 1):
                block = self.profiles[b - 1]
                if block.param_count and covered[b - 1]:
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


def check_stage_count(num_blocks: int, num_stages: int) -> None:
    """At least one stage, and at most one per block."""
    if num_stages < 1:
        raise PartitionError(f"parallel.pp = {num_stages}: expected at least one stage")
    if num_stages > num_blocks:
        raise PartitionError(
            f"parallel.pp = {num_stages} stages but the model has only {num_blocks} blocks: "
            f"use at most {num_blocks} stages or a deeper model"
        )
