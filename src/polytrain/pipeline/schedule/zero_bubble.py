"""Zero-bubble schedules: the backward split into I and W (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024): ZB-H1 (section 2.1) and the V-shaped ZBV (section 6 of the arXiv
version, 2401.10241).

A stage's backward has two halves: ``I`` computes the gradient of the stage's input, which the
previous stage is waiting for; ``W`` computes the gradient of the stage's weights, which nobody
waits for until the optimizer step. Running every ``I`` as early as possible and moving ``W``
into the idle steps shortens the pipeline's critical path. (The paper calls our ``I`` "B".)

`zb_h1(4, 6)` with ``F = I = W`` one step each (``render(..., durations=ZERO_BUBBLE_DURATIONS)``)::

       step    0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17  18  19  20
       rank 0  0F0 0F1 0F2 0F3 .   .   .   0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5
       rank 1  .   1F0 1F1 1F2 .   .   1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1I4 1W3 1I5 1W4 1W5
       rank 2  .   .   2F0 2F1 .   2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2I5 2W3 2W4 2W5
       rank 3  .   .   .   3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3W3 3W4 3W5

`zbv(2, 4)`, two stages per rank in a V (rank ``r`` holds stages ``r`` and ``2p - 1 - r``), same
durations::

       step    0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17  18  19  20  21  22  23  24
       rank 0  0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3 .
       rank 1  .   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3

[Note: ZB-H1 order] Rank ``r`` runs 1F1B's order (`one_f_one_b`: ``min(p - 1 - r, m)``
warm-up forwards, then one forward and one I, then the remaining I) with every B replaced by
its I, and runs the W of micro-batch ``k`` right after the I of micro-batch ``k + r``, the
last ``r`` W after the last I. So ``r`` weight gradients wait at a time on rank ``r``, which
keeps ``p`` micro-batches' activations in flight on every rank (counting an activation until
its W): the peak of 1F1B's first stage, reached on every rank. With ``m >= p`` and
``T_W <= min(T_F, T_I)``, each rank idles ``(p - 1)(T_F + T_I - T_W)`` (the paper's
``(p - 1)(T_F + T_B - T_W)``) where 1F1B idles ``(p - 1)(T_F + T_I + T_W)``: one third of it
when the three are equal. The tests measure both on the simulated grid.

[Note: ZBV order] For rank ``r`` with chunk-0 stage ``a = r`` and chunk-1 stage ``b = 2p-1-r``:
``2(p - r) - 1`` forwards of ``a``; ``r`` pairs (F of ``b``, F of ``a``); ``p - r`` triples
(F, I, W of ``b``); then the steady state, rounds of (F, I, W of ``a``; F, I, W of ``b``) until
all forwards ran; then ``r`` pairs (I of ``a``, I of ``b``), ``p - r`` pairs (I, W of ``a``)
and the W still owed, ``b``'s first. The phases are built for ``n = max(m, 2p - 1)``
micro-batches and the actions of micro-batches ``>= m`` are dropped: removing whole
micro-batches from every rank keeps the order deadlock-free (what remains is a sub-order of a
runnable one), so any ``m >= 1`` is accepted. With F, I and W one step per chunk and
``m >= 2p - 1``, no rank ever idles between its first and its last action: rank ``r`` starts
``r`` steps late (its first input needs ``r`` forwards) and ends ``p - 1 - r`` steps early,
``p - 1`` idle steps whatever ``m``. That staircase is the paper's "zero bubble" (a rank that
ends early can start its optimizer step); counted as bubble it is a ratio of
``(p - 1) / (6 m)``, against ZB-H1's ``(p - 1) / (3 m)``. Each rank holds ``2 p`` chunk
activations at its peak: ``p`` whole stages' worth, 1F1B's first-stage peak.
"""

from __future__ import annotations

from collections.abc import Iterable

from polytrain.pipeline.schedule.action import Action, ActionKind, Schedule, check_count
from polytrain.pipeline.schedule.one_f_one_b import num_warmup
from polytrain.pipeline.schedule.stage_map import StageMap

__all__ = ["zb_h1", "zbv", "zbv_stage_map"]


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1 over one stage per rank; see [Note: ZB-H1 order]."""
    check_count("num_ranks", num_ranks, "parallel.pp")
    check_count("num_microbatches", num_microbatches, "pipeline.microbatches")
    p, m = num_ranks, num_microbatches
    schedule: Schedule = {}
    for rank in range(p):
        warmup = num_warmup(rank, p, m)
        actions: list[Action | None] = [Action(rank, ActionKind.F, i) for i in range(warmup)]
        for k in range(m):
            if warmup + k < m:
                actions.append(Action(rank, ActionKind.F, warmup + k))
            actions.append(Action(rank, ActionKind.I, k))
            if k >= rank:
                actions.append(Action(rank, ActionKind.W, k - rank))
        actions += [Action(rank, ActionKind.W, i) for i in range(max(0, m - rank), m)]
        schedule[rank] = actions
    return schedule


def zbv_stage_map(num_ranks: int) -> StageMap:
    """Two stages per rank in a V: rank ``r`` holds stages ``r`` and ``2p - 1 - r``."""
    return StageMap(num_ranks, 2, "v")


def zbv(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZBV over ``2p`` stages placed in a V; see [Note: ZBV order]."""
    check_count("num_ranks", num_ranks, "parallel.pp")
    check_count("num_microbatches", num_microbatches, "pipeline.microbatches")
    p, m = num_ranks, num_microbatches
    n = max(m, 2 * p - 1)
    schedule: Schedule = {}
    for rank in range(p):
        program = _ZbvProgram(rank, 2 * p - 1 - rank)
        a, b = program.a, program.b
        F, I, W = ActionKind.F, ActionKind.I, ActionKind.W  # noqa: E741
        program.run((a, F) for _ in range(2 * (p - rank) - 1))
        program.run(step for _ in range(rank) for step in ((b, F), (a, F)))
        program.run(step for _ in range(p - rank) for step in ((b, F), (b, I), (b, W)))
        while program.count(b, F) < program.count(a, F) or program.count(a, F) < n:
            if program.count(a, F) < n:
                program.run([(a, F)])
            program.run([(a, I), (a, W), (b, F), (b, I), (b, W)])
        program.run(step for _ in range(rank) for step in ((a, I), (b, I)))
        program.run(step for _ in range(p - rank) for step in ((a, I), (a, W)))
        program.run((b, W) for _ in range(program.count(b, I) - program.count(b, W)))
        program.run((a, W) for _ in range(program.count(a, I) - program.count(a, W)))
        assert all(program.count(s, k) == n for s in (a, b) for k in (F, I, W)), program.counts
        schedule[rank] = [x for x in program.actions if x.microbatch_index < m]
    return schedule


class _ZbvProgram:
    """One rank's actions under construction: each (stage, kind) takes micro-batches in order."""

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b = a, b
        self.actions: list[Action] = []
        self.counts: dict[tuple[int, ActionKind], int] = {}

    def count(self, stage: int, kind: ActionKind) -> int:
        return self.counts.get((stage, kind), 0)

    def run(self, steps: Iterable[tuple[int, ActionKind]]) -> None:
        for stage, kind in steps:
            self.actions.append(Action(stage, kind, self.count(stage, kind)))
            self.counts[(stage, kind)] = self.count(stage, kind) + 1
