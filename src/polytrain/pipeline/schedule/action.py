"""Action IR of pipeline schedules: one compute or communication step of one stage.

The spelling follows ``torch.distributed.pipelining`` (its ``_Action``), the IR that GPipe
(Huang et al. 2019), PipeDream (Narayanan et al. SOSP 2019), interleaved 1F1B (Narayanan et al.
SC'21) and zero-bubble (Qi et al. ICLR 2024) schedules are written in here. An action prints as
``<stage_index><kind><microbatch_index>``:

=============  ================================================================
``"2F0"``      stage 2 runs the forward of micro-batch 0
``"1B3"``      stage 1 runs the full backward of micro-batch 3 (input and weights)
``"1I3"``      stage 1 runs the input-gradient half of that backward (zero bubble's B)
``"1W3"``      stage 1 runs the weight-gradient half, after ``1I3`` (zero bubble's W)
``"2SEND_F0"`` stage 2 sends the activations of micro-batch 0 to stage 3
``"3RECV_F0"`` stage 3 receives the activations of micro-batch 0 from stage 2
``"2SEND_B1"`` stage 2 sends the input gradient of micro-batch 1 to stage 1
``"1RECV_B1"`` stage 1 receives the gradient of micro-batch 1 from stage 2
=============  ================================================================

A communication action is named after the stage that runs it; its peer is `Action.peer_stage`.
A micro-batch's backward on a stage is either one ``B`` or an ``I`` followed by a ``W``: ``I``
needs the gradient of the stage's output (from the next stage's ``B`` or ``I``) and produces the
gradient sent back; ``W`` needs only the same stage's ``I`` and sends nothing.

[Note: schedule as data] A schedule is a plain ``dict[int, list[Action | None]]`` (`Schedule`)
mapping each pipeline rank to the actions it runs, in program order. An action's
``stage_index`` is a virtual stage; a `StageMap` says which rank holds it ([Note: stages and
ranks] in `stage_map`). With the default map, one stage per rank, every action of rank ``r``
has ``stage_index == r``. ``None`` is an empty slot, allowed
for compatibility with torch's format: generators never emit it, `lower` drops it and the
simulator skips it (timing comes from simulation, not from slot positions). Functions that only
read a schedule accept any ``Mapping[int, Sequence[Action | None]]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from polytrain.errors import ScheduleError

__all__ = ["Action", "ActionKind", "Schedule", "check_count", "check_sizes"]


class ActionKind(str, Enum):
    """What an action does; the value is its spelling inside an action string."""

    F = "F"
    """Forward of one micro-batch through the stage."""
    B = "B"
    """Backward of one micro-batch through the stage (input and weight gradients)."""
    I = "I"  # noqa: E741 -- torch's spelling of "backward input"
    """Input-gradient half of a backward: needs the output gradient, sends the input gradient."""
    W = "W"
    """Weight-gradient half of a backward: after the I of the same stage and micro-batch."""
    SEND_F = "SEND_F"
    """Send the stage's output activations to the next stage."""
    RECV_F = "RECV_F"
    """Receive the input activations from the previous stage."""
    SEND_B = "SEND_B"
    """Send the gradient of the stage's input to the previous stage."""
    RECV_B = "RECV_B"
    """Receive the gradient of the stage's output from the next stage."""


_COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
_PEER_OFFSET = {
    ActionKind.SEND_F: 1,
    ActionKind.RECV_F: -1,
    ActionKind.SEND_B: -1,
    ActionKind.RECV_B: 1,
}
# Longer kinds first so that "SEND_F" is not read as a stray "F".
_KINDS = "|".join(sorted((kind.value for kind in ActionKind), key=len, reverse=True))
_PATTERN = re.compile(rf"(0|[1-9][0-9]*)({_KINDS})(0|[1-9][0-9]*)")
_FORM = (
    "expected '<stage_index><kind><microbatch_index>' with kind one of "
    + ", ".join(kind.value for kind in ActionKind)
    + ", e.g. '2F0', '1B3', '1I3', '1W3' or '3RECV_F0'"
)


@dataclass(frozen=True, repr=False)
class Action:
    """One action of one pipeline stage; prints as ``"2F0"`` and parses back with `parse`."""

    stage_index: int
    kind: ActionKind
    microbatch_index: int

    def __post_init__(self) -> None:
        s, m = self.stage_index, self.microbatch_index
        if (
            type(s) is int
            and type(m) is int
            and s >= 0
            and m >= 0
            and type(self.kind) is ActionKind
        ):
            return  # the common case, checked cheaply (lowering builds millions of actions)
        for name in ("stage_index", "microbatch_index"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"Action.{name} = {value!r}: expected an integer >= 0")
        if not isinstance(self.kind, ActionKind):
            raise ScheduleError(f"Action.kind = {self.kind!r}: {_FORM}")

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read an action from its printed form: ``Action.parse(str(a)) == a``."""
        match = _PATTERN.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(f"cannot parse action {text!r}: {_FORM}")
        stage, kind, microbatch = match.groups()
        return cls(int(stage), ActionKind(kind), int(microbatch))

    def __str__(self) -> str:
        return f"{self.stage_index}{self.kind.value}{self.microbatch_index}"

    # Short like torch's _Action, so lists of actions read as schedules in test failures.
    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W, which take time on the rank; False for sends and receives."""
        return self.kind in _COMPUTE

    @property
    def peer_stage(self) -> int | None:
        """The stage at the other end of a send or receive; None for compute actions."""
        offset = _PEER_OFFSET.get(self.kind)
        return None if offset is None else self.stage_index + offset


Schedule: TypeAlias = dict[int, list[Action | None]]
"""Rank -> that rank's actions in program order; see [Note: schedule as data]."""


def check_sizes(num_stages: int, num_microbatches: int) -> None:
    """Raise `ScheduleError` unless both counts are integers >= 1."""
    check_count("num_stages", num_stages, "parallel.pp")
    check_count("num_microbatches", num_microbatches, "pipeline.microbatches")


def check_count(name: str, value: object, field: str) -> None:
    """Raise `ScheduleError` unless ``value`` is an integer >= 1 (``field``: what to set)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ScheduleError(
            f"{name} = {value!r}: expected an integer >= 1; set {field} to 1 or more"
        )
