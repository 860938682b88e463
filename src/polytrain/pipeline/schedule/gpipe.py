"""GPipe fill-drain schedule: every forward, then every backward (Huang et al. 2019).

``gpipe(4, 4)`` simulated with F and B one step each (``render``; ``.`` is idle)::

       step    0   1   2   3   4   5   6   7   8   9   10  11  12  13
       rank 0  0F0 0F1 0F2 0F3 .   .   .   .   .   .   0B3 0B2 0B1 0B0
       rank 1  .   1F0 1F1 1F2 1F3 .   .   .   .   1B3 1B2 1B1 1B0 .
       rank 2  .   .   2F0 2F1 2F2 2F3 .   .   2B3 2B2 2B1 2B0 .   .
       rank 3  .   .   .   3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0 .   .   .

Each stage runs the forwards of micro-batches ``0 .. m-1`` in order, then their backwards in
reverse order ``m-1 .. 0`` -- the order a single autograd backward over the concatenated
micro-batches would take, so the last micro-batch's activations, the freshest, are freed first.
A stage holds the activations of all ``m`` micro-batches at the turn (GPipe trades that memory
for re-materialization, which is the runtime's business, not the schedule's).
"""

from __future__ import annotations

from polytrain.pipeline.schedule.action import Action, ActionKind, Schedule, check_sizes

__all__ = ["gpipe"]


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """Fill-drain schedule: rank ``s`` runs ``sF0 .. sF(m-1)`` then ``sB(m-1) .. sB0``."""
    check_sizes(num_stages, num_microbatches)
    schedule: Schedule = {}
    for stage in range(num_stages):
        forwards = [Action(stage, ActionKind.F, i) for i in range(num_microbatches)]
        backwards = [Action(stage, ActionKind.B, i) for i in reversed(range(num_microbatches))]
        schedule[stage] = [*forwards, *backwards]
    return schedule
