"""Lowering: add the point-to-point sends and receives a compute-only schedule implies.

The communication pass of ``torch.distributed.pipelining`` (``_add_send_recv``), for the
schedules of GPipe (Huang et al. 2019) and PipeDream (Narayanan et al. SOSP 2019, 2021).

Rules, for stage ``s`` of ``p``:

* before ``sF i`` on ``s > 0``: ``sRECV_F i`` (activations from ``s - 1``);
* after ``sF i`` on ``s < p - 1``: ``sSEND_F i`` (activations to ``s + 1``);
* before ``sB i`` on ``s < p - 1``: ``sRECV_B i`` (output gradient from ``s + 1``);
* after ``sB i`` on ``s > 0``: ``sSEND_B i`` (input gradient to ``s - 1``).

Example, ``lower(one_f_one_b(2, 2))``::

    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
    rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1

[Note: runtime assumption] The runtime runs each rank's actions in order with *non-blocking
sends* (``isend``, kept alive until completed at the end of the step) and *blocking receives*.
Under that rule a lowered schedule that `validate` accepts cannot deadlock: each receive waits
only for a send that its peer posts right after a compute action the simulator has shown to
finish. A runtime may instead fuse a send with the receive that follows it into one
``batch_isend_irecv`` (Megatron's ``send_forward_recv_backward``); that is equivalent. What is
*not* safe is a blocking ``send``: in 1F1B's steady state stage ``s`` sends ``F i`` while stage
``s + 1`` sends ``B j``, and both would wait for the other's receive forever.
Point-to-point messages between two ranks are matched in order, so sends and receives must
appear in the same micro-batch order on both sides; lowering keeps the compute order, and
`validate` checks it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from polytrain.errors import ScheduleError
from polytrain.pipeline.schedule.action import Action, ActionKind, Schedule, num_stages_of

__all__ = ["lower"]


def lower(schedule: Mapping[int, Sequence[Action | None]]) -> Schedule:
    """Return a new schedule with sends and receives around every F and B; drops ``None``."""
    num_stages = num_stages_of(schedule)
    lowered: Schedule = {}
    for rank in range(num_stages):
        actions: list[Action | None] = []
        for action in schedule[rank]:
            if action is None:
                continue
            if not action.is_compute:
                raise ScheduleError(
                    f"cannot lower a schedule that already has communication ({action} on rank "
                    f"{rank}): expected only F and B actions; pass the schedule from the generator"
                )
            stage, i = action.stage_index, action.microbatch_index
            if action.kind is ActionKind.F:
                if stage > 0:
                    actions.append(Action(stage, ActionKind.RECV_F, i))
                actions.append(action)
                if stage < num_stages - 1:
                    actions.append(Action(stage, ActionKind.SEND_F, i))
            else:
                if stage < num_stages - 1:
                    actions.append(Action(stage, ActionKind.RECV_B, i))
                actions.append(action)
                if stage > 0:
                    actions.append(Action(stage, ActionKind.SEND_B, i))
        lowered[rank] = actions
    return lowered
