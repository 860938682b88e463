"""Synchronous 1F1B (PipeDream-flush) schedule: warm-up, one forward one backward, cool-down.

PipeDream-flush, Narayanan et al. 2021 ("Memory-efficient pipeline-parallel DNN training");
the same order as Megatron-LM's and ``torch.distributed.pipelining``'s ``Schedule1F1B``.

``one_f_one_b(4, 6)`` simulated with F and B one step each (``render``; ``.`` is idle)::

       step    0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17
       rank 0  0F0 0F1 0F2 0F3 .   .   .   0B0 0F4 0B1 0F5 0B2 .   0B3 .   0B4 .   0B5
       rank 1  .   1F0 1F1 1F2 .   .   1B0 1F3 1B1 1F4 1B2 1F5 1B3 .   1B4 .   1B5 .
       rank 2  .   .   2F0 2F1 .   2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 .   2B5 .   .
       rank 3  .   .   .   3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 .   .   .

Stage ``s`` of ``p`` runs ``w = min(p - 1 - s, m)`` warm-up forwards, then alternates one
forward and one backward (``F(w+k)``, ``B(k)``) until every forward has run, then the remaining
backwards (cool-down). Backwards run in micro-batch order ``0 .. m-1``. The pipeline flushes at
the end of the step: all gradients are accumulated before the optimizer step, so the result is
GPipe's (synchronous semantics), with the same bubble but at most ``min(p - s, m)`` micro-batches'
activations in flight on stage ``s`` instead of ``m``.
"""

from __future__ import annotations

from polytrain.pipeline.schedule.action import Action, ActionKind, Schedule, check_sizes

__all__ = ["num_warmup", "one_f_one_b"]


def num_warmup(stage_index: int, num_stages: int, num_microbatches: int) -> int:
    """Forwards stage ``stage_index`` runs before its first backward: ``min(p - 1 - s, m)``."""
    return min(num_stages - 1 - stage_index, num_microbatches)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B with a flush at the end of the step; see the module docstring for the order."""
    check_sizes(num_stages, num_microbatches)
    schedule: Schedule = {}
    for stage in range(num_stages):
        warmup = num_warmup(stage, num_stages, num_microbatches)
        actions: list[Action | None] = [Action(stage, ActionKind.F, i) for i in range(warmup)]
        for k in range(num_microbatches - warmup):
            actions.append(Action(stage, ActionKind.F, warmup + k))
            actions.append(Action(stage, ActionKind.B, k))
        actions += [
            Action(stage, ActionKind.B, i)
            for i in range(num_microbatches - warmup, num_microbatches)
        ]
        schedule[stage] = actions
    return schedule
