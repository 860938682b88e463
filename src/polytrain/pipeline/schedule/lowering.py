"""Lowering: add the point-to-point sends and receives a compute-only schedule implies.

The communication pass of ``torch.distributed.pipelining`` (``_add_send_recv``), for the
schedules of GPipe (Huang et al. 2019), PipeDream (Narayanan et al. SOSP 2019, 2021),
interleaved 1F1B (Narayanan et al. SC'21) and zero bubble (Qi et al. ICLR 2024).

Rules, for virtual stage ``s`` of ``S``, where a neighbour counts only if it lives on another
rank (`StageMap.is_local`):

* before ``sF i`` on ``s > 0``: ``sRECV_F i`` (activations from ``s - 1``);
* after ``sF i`` on ``s < S - 1``: ``sSEND_F i`` (activations to ``s + 1``);
* before ``sB i`` or ``sI i`` on ``s < S - 1``: ``sRECV_B i`` (output gradient from ``s + 1``);
* after ``sB i`` or ``sI i`` on ``s > 0``: ``sSEND_B i`` (input gradient to ``s - 1``);
* ``sW i`` exchanges nothing.

Example, ``lower(one_f_one_b(2, 2))``::

    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
    rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1

[Note: local hand-off] Two consecutive stages on one rank (the tip of ZBV's V: stages ``p - 1``
and ``p`` on rank ``p - 1``; every stage when ``p = 1``) get no send and no receive: the runtime
keeps the output of ``sF i`` and feeds it to ``(s+1)F i`` itself, and likewise the input
gradient of ``(s+1)I i`` (or ``B``) to ``sI i``. So a stage's forward input comes from the data
(``s = 0``), from ``RECV_F`` (the previous stage is remote) or from the same rank's earlier
``(s-1)F i`` (it is local); the simulator's dependencies order the local case, and the order of
the rank's own program already guarantees it for every schedule `validate` accepts.

[Note: runtime assumption] The runtime runs each rank's actions in order with *non-blocking
sends* (``isend``, kept alive until completed at the end of the step) and *blocking receives*.
Under that rule a lowered schedule that `validate` accepts cannot deadlock: each receive waits
only for a send that its peer posts right after a compute action the simulator has shown to
finish. A runtime may instead fuse a send with the receive that follows it into one
``batch_isend_irecv`` (Megatron's ``send_forward_recv_backward``); that is equivalent. What is
*not* safe is a blocking ``send``: in 1F1B's steady state stage ``s`` sends ``F i`` while stage
``s + 1`` sends ``B j``, and both would wait for the other's receive forever.
Point-to-point messages are matched in order per *channel*: one direction of one rank pair,
for one kind of tensor (activations or gradients, which the runtime keeps on separate process
groups). With several stages per rank a channel carries several stages' messages (interleaved
1F1B's rank ``p - 1`` sends stage ``p - 1``'s and stage ``2p - 1``'s activations to rank 0), so
the receiver must take them in the order the sender sends them, across stages. Lowering keeps
the compute order, and `validate` checks that order on every channel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from polytrain.errors import ScheduleError
from polytrain.pipeline.schedule.action import Action, ActionKind, Schedule
from polytrain.pipeline.schedule.stage_map import StageMap

__all__ = ["P2PMessage", "lower", "p2p_message"]


class P2PMessage(NamedTuple):
    """The message a send or receive moves; equal on both ends of a matched pair."""

    tensor: Literal["activations", "gradients"]
    src_rank: int
    dst_rank: int
    src_stage: int  # the stage whose F (activations) or B/I (gradients) produced it
    microbatch_index: int

    @property
    def channel(self) -> tuple[str, int, int]:
        """``(tensor, src_rank, dst_rank)``: messages on one channel match in program order
        ([Note: runtime assumption]); a runtime keys its p2p groups and posted receives by it."""
        return (self.tensor, self.src_rank, self.dst_rank)


def p2p_message(action: Action, stage_map: StageMap) -> P2PMessage | None:
    """What a lowered SEND_F, RECV_F, SEND_B or RECV_B moves, and between which ranks; None
    for compute actions."""
    stage, i = action.stage_index, action.microbatch_index
    tensor: Literal["activations", "gradients"]
    match action.kind:
        case ActionKind.SEND_F:
            src, dst, tensor = stage, stage + 1, "activations"
        case ActionKind.RECV_F:
            src, dst, tensor = stage - 1, stage, "activations"
        case ActionKind.SEND_B:
            src, dst, tensor = stage, stage - 1, "gradients"
        case ActionKind.RECV_B:
            src, dst, tensor = stage + 1, stage, "gradients"
        case _:
            return None
    return P2PMessage(tensor, stage_map.rank_of(src), stage_map.rank_of(dst), src, i)


def lower(
    schedule: Mapping[int, Sequence[Action | None]], *, stage_map: StageMap | None = None
) -> Schedule:
    """Return a new schedule with sends and receives around every F, B and I; drops ``None``.

    ``stage_map`` defaults to `StageMap.infer` (one stage per rank for GPipe and 1F1B).
    """
    stage_map = StageMap.infer(schedule) if stage_map is None else stage_map
    last = stage_map.num_stages - 1
    lowered: Schedule = {}
    for rank in range(stage_map.num_ranks):
        actions: list[Action | None] = []
        for action in schedule[rank]:
            if action is None:
                continue
            if not action.is_compute:
                raise ScheduleError(
                    f"cannot lower a schedule that already has communication ({action} on rank "
                    f"{rank}): expected only compute actions; pass the schedule from the generator"
                )
            stage, i = action.stage_index, action.microbatch_index
            prev_remote = stage > 0 and not stage_map.is_local(stage, stage - 1)
            next_remote = stage < last and not stage_map.is_local(stage, stage + 1)
            if action.kind is ActionKind.F:
                if prev_remote:
                    actions.append(Action(stage, ActionKind.RECV_F, i))
                actions.append(action)
                if next_remote:
                    actions.append(Action(stage, ActionKind.SEND_F, i))
            elif action.kind is ActionKind.W:
                actions.append(action)
            else:  # B or I: the gradient comes in from stage + 1 and goes out to stage - 1
                if next_remote:
                    actions.append(Action(stage, ActionKind.RECV_B, i))
                actions.append(action)
                if prev_remote:
                    actions.append(Action(stage, ActionKind.SEND_B, i))
        lowered[rank] = actions
    return lowered
