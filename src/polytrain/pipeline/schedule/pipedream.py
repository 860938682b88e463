"""Asynchronous 1F1B without flush, with weight stashing: PipeDream (Narayanan et al. SOSP 2019).

``pipedream(3, 6)``: the first six micro-batches of a stream, simulated (``render``)::

       step    0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15
       rank 0  0F0 0F1 0F2 .   .   0B0 0F3 0B1 0F4 0B2 0F5 0B3 .   0B4 .   0B5
       rank 1  .   1F0 1F1 .   1B0 1F2 1B1 1F3 1B2 1F4 1B3 1F5 1B4 .   1B5 .
       rank 2  .   .   2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4 2F5 2B5 .   .

[Note: PipeDream semantics] The order is 1F1B's (`one_f_one_b`; PipeDream's "1F1B-RR" with one
worker per stage admits ``p`` micro-batches during startup, which is stage 0's ``p - 1`` warm-up
forwards plus its first steady forward). What differs is what the runtime does with it:

* Each stage applies its optimizer update right after every backward, on its own, instead of
  accumulating gradients until a flush. ``pipedream(p, m)`` describes a stream of ``m``
  consecutive micro-batches (e.g. ``steps x micro-batches per step``) run back to back; its
  drain happens once, at the end of the stream, not at every step.
* Weight stashing: the forward of micro-batch ``i`` on stage ``s`` runs on the stage's newest
  weights, which have had ``weight_version(s, i, p) = max(0, i - (p - 1 - s))`` updates; the
  runtime stashes that version and the backward of ``i`` uses it again, so each micro-batch sees
  one consistent set of weights per stage. When the backward of ``i`` runs, the stage has
  applied ``i`` updates, so the gradient is stale by up to ``p - 1 - s`` updates (``0`` on the
  last stage). Different stages use different versions for the same micro-batch; PipeDream's
  "vertical sync" would align them and is not done here.
* At most ``max_in_flight(s, p) = p - s`` micro-batches are between forward and backward on
  stage ``s``, and they use at most ``p - s`` distinct weight versions (the newest one being the
  live weights), which bounds the stash.

Weight version used by micro-batch ``i`` (forward and, through the stash, backward), ``p = 4``::

    micro-batch  0 1 2 3 4 5 6 7
    stage 0      0 0 0 0 1 2 3 4
    stage 1      0 0 0 1 2 3 4 5
    stage 2      0 0 1 2 3 4 5 6
    stage 3      0 1 2 3 4 5 6 7
"""

from __future__ import annotations

from polytrain.errors import ScheduleError
from polytrain.pipeline.schedule.action import Schedule, check_sizes
from polytrain.pipeline.schedule.one_f_one_b import one_f_one_b

__all__ = ["max_in_flight", "pipedream", "stash_bound", "weight_version"]


def pipedream(num_stages: int, num_microbatches: int) -> Schedule:
    """Asynchronous 1F1B over a stream of micro-batches; see [Note: PipeDream semantics]."""
    return one_f_one_b(num_stages, num_microbatches)


def max_in_flight(stage_index: int, num_stages: int) -> int:
    """Most micro-batches (and weight versions to stash) in flight on a stage: ``p - s``."""
    _check_stage(stage_index, num_stages)
    return num_stages - stage_index


def weight_version(
    stage_index: int, microbatch_index: int, num_stages: int, update_every: int = 1
) -> int:
    """Updates stage ``s`` has applied when micro-batch ``i``'s forward runs (1F1B order).

    With an update after every ``u``-th backward: ``max(0, (i - (p - 1 - s)) // u)``; the
    backward of the same micro-batch uses this stashed version. ``u = 1`` is PipeDream (2019),
    ``u = m`` PipeDream-2BW's double buffering. The forward of ``i`` follows the backward of
    ``i - (p - 1 - s) - 1``.
    """
    _check_stage(stage_index, num_stages)
    _check_update_every(update_every)
    if not isinstance(microbatch_index, int) or microbatch_index < 0:
        raise ScheduleError(f"microbatch_index = {microbatch_index!r}: expected an integer >= 0")
    return max(0, (microbatch_index - (num_stages - 1 - stage_index)) // update_every)


def stash_bound(stage_index: int, num_stages: int, update_every: int = 1) -> int:
    """Most weight versions a stage holds at once: ``ceil((p - 1 - s) / u) + 1``.

    At most ``p - s`` consecutive micro-batches are in flight (`max_in_flight`), and their
    versions (`weight_version`) take at most this many distinct values; ``p - s`` for
    ``u = 1``. The runtime's stash is sized by it and the partition search charges it.
    """
    _check_stage(stage_index, num_stages)
    _check_update_every(update_every)
    return -(-(num_stages - 1 - stage_index) // update_every) + 1


def _check_update_every(update_every: int) -> None:
    if not isinstance(update_every, int) or update_every < 1:
        raise ScheduleError(f"update_every = {update_every!r}: expected an integer >= 1")


def _check_stage(stage_index: int, num_stages: int) -> None:
    check_sizes(num_stages, 1)
    if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
        raise ScheduleError(
            f"stage_index = {stage_index!r}: expected an integer in 0..{num_stages - 1} "
            f"for a pipeline of {num_stages} stages"
        )
