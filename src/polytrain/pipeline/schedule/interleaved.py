"""Interleaved 1F1B: ``v`` model chunks per rank, placed in a loop (Narayanan et al. SC'21).

"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section
2.2.2; the order is Megatron-LM's ``forward_backward_pipelining_with_interleaving`` (and
``torch.distributed.pipelining``'s ``ScheduleInterleaved1F1B`` when ``m`` is a multiple of
``p``). The model is cut into ``S = p v`` virtual stages; rank ``r`` holds stages
``r, r + p, ..., r + (v-1) p`` (`StageMap` style ``"loop"``).

``interleaved_1f1b(2, 4, 2)`` simulated with F and B one step each (``render``; ``.`` is idle)::

       step    0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17
       rank 0  0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 .   2B2 .   2B3 0B2 0B3
       rank 1  .   1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 .

Order: rank ``r`` sees its ``m v`` (chunk, micro-batch) pairs in groups of ``p`` micro-batches:
forwards take chunk 0 for micro-batches ``0 .. p-1``, chunk 1 for the same ``p``, ..., chunk
``v - 1``, then the next ``p`` micro-batches; backwards walk the chunks the other way
(``v - 1`` first). Rank ``r`` runs ``w = min(2 (p - 1 - r) + (v - 1) p, m v)`` warm-up
forwards, then alternates one forward and one backward, then drains the backwards.

Bubble: each chunk's F and B take ``1 / v`` of a whole stage's, so the fill and drain cost
``(p - 1) (t_f + t_b) / v`` against an ideal ``m (t_f + t_b)``: a ratio ``(p - 1) / (v m)``
(`formulas.interleaved_bubble_ratio`; the simulated grid hits it exactly, for ``B = F`` and
``B = 2F``). Memory: rank 0 holds ``min(v p + p - 1, v m)`` chunk activations at its peak, that
is ``p (1 + (p - 1) / (p v))`` stages' worth against 1F1B's ``p`` (Korthikanti et al. 2022).

[Note: interleaved micro-batch count] Megatron's order needs ``m`` to be a multiple of ``p``
(its groups of ``p``); torch relaxes it with larger groups, at the cost of the exact bubble and
of more activations in flight. We keep Megatron's rule and refuse other ``m`` with a
`ScheduleError` naming the nearest valid counts. ``v = 1`` is plain 1F1B (`one_f_one_b`), for
any ``m``.
"""

from __future__ import annotations

from polytrain.errors import ScheduleError
from polytrain.pipeline.schedule.action import Action, ActionKind, Schedule, check_count
from polytrain.pipeline.schedule.one_f_one_b import one_f_one_b
from polytrain.pipeline.schedule.stage_map import StageMap

__all__ = ["interleaved_1f1b", "interleaved_num_warmup", "interleaved_stage_map"]


def interleaved_stage_map(num_ranks: int, virtual_stages: int) -> StageMap:
    """Stage ``s`` on rank ``s % p``: the placement `interleaved_1f1b` is written for."""
    return StageMap(num_ranks, virtual_stages, "loop")


def interleaved_num_warmup(
    rank: int, num_ranks: int, num_microbatches: int, virtual_stages: int
) -> int:
    """Forwards rank ``r`` runs before its first backward: ``min(2 (p-1-r) + (v-1) p, m v)``."""
    p, v = num_ranks, virtual_stages
    return min(2 * (p - 1 - rank) + (v - 1) * p, num_microbatches * v)


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B over ``p * v`` virtual stages; see the module docstring."""
    check_count("num_ranks", num_ranks, "parallel.pp")
    check_count("num_microbatches", num_microbatches, "pipeline.microbatches")
    check_count("virtual_stages", virtual_stages, "the virtual stages per rank")
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        lower, upper = (m // p) * p, (m // p + 1) * p
        fix = f"{lower} or {upper}" if lower else f"{upper}"
        raise ScheduleError(
            f"num_microbatches = {m}: interleaved 1F1B needs a multiple of num_ranks = {p} "
            f"(Megatron's groups of {p}); set pipeline.microbatches to {fix}"
        )
    stage_map = interleaved_stage_map(p, v)
    schedule: Schedule = {}
    for rank in range(p):
        stages = stage_map.stages_of(rank)

        def forward(k: int, stages: tuple[int, ...] = stages) -> Action:
            return Action(stages[(k // p) % v], ActionKind.F, _microbatch(k, p, v))

        def backward(k: int, stages: tuple[int, ...] = stages) -> Action:
            return Action(stages[v - 1 - (k // p) % v], ActionKind.B, _microbatch(k, p, v))

        total = m * v
        warmup = interleaved_num_warmup(rank, p, m, v)
        actions: list[Action | None] = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        actions += [backward(k) for k in range(total - warmup, total)]
        schedule[rank] = actions
    return schedule


def _microbatch(k: int, p: int, v: int) -> int:
    """Micro-batch of a rank's ``k``-th forward (or backward): group ``k // (p v)``, then
    position ``k % p`` within the group."""
    return (k // (p * v)) * p + k % p
