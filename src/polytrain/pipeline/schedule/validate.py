"""Check a pipeline schedule and simulate it step by step (GPipe, Huang et al. 2019; PipeDream,
Narayanan et al. SOSP 2019 and 2021).

`validate` checks counts, per-rank order, the pairing of sends and receives, and that the
schedule runs to the end; a failure raises `ScheduleError` whose first line is the summary and
whose next lines are a rank x slot (program order) or rank x step (simulated time) grid with the
offending rank marked ``>>`` and the offending cells marked ``!``.

[Note: time model] `simulate` runs all ranks in lock-step. F and B take one step each; sends and
receives take no time. At each step, first every send and receive that can run does
(repeatedly, so a receive matches a send posted in the same instant), then every rank whose next
action is F or B and whose dependencies completed before this step runs it. Dependencies:

* ``sF i`` needs ``(s-1)F i``;
* ``sB i`` needs ``sF i`` and ``(s+1)B i``;
* ``sRECV_F i`` needs ``(s-1)SEND_F i`` and ``sRECV_B i`` needs ``(s+1)SEND_B i``;
* sends need nothing but their place in program order (non-blocking ``isend``; see
  [Note: runtime assumption] in `lowering`).

Each rank runs its actions strictly in program order. Hence a lowered schedule simulates to the
same grid as its compute-only source, and a schedule runs to the end iff it cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import NoReturn

from polytrain.errors import ScheduleError
from polytrain.pipeline.schedule._grid import format_grid
from polytrain.pipeline.schedule.action import Action, ActionKind, check_sizes, num_stages_of

__all__ = ["simulate", "validate"]

_ScheduleIn = Mapping[int, Sequence[Action | None]]
_Cell = tuple[int, int]

# (earlier kind, later kind, same-rank rule) pairs for one micro-batch, and why.
_PROGRAM_ORDER = (
    (ActionKind.F, ActionKind.B, "each backward after the forward of its micro-batch"),
    (ActionKind.RECV_F, ActionKind.F, "the activations received before the forward"),
    (ActionKind.F, ActionKind.SEND_F, "the activations sent after the forward"),
    (ActionKind.RECV_B, ActionKind.B, "the gradient received before the backward"),
    (ActionKind.B, ActionKind.SEND_B, "the gradient sent after the backward"),
)


def validate(schedule: _ScheduleIn, num_stages: int, num_microbatches: int) -> None:
    """Raise `ScheduleError` with a grid unless ``schedule`` is a correct pipeline schedule.

    Compute-only and lowered (`lower`) schedules are both accepted; a schedule is lowered when
    it has any send or receive, and then it must have exactly the ones `lower` would add.
    """
    check_sizes(num_stages, num_microbatches)
    if set(schedule) != set(range(num_stages)):
        _fail(
            f"schedule has ranks {sorted(schedule)}: expected ranks 0..{num_stages - 1} "
            f"(one stage per rank for {num_stages} stages)",
            schedule,
        )
    slots = _slots(schedule)
    lowered = any(not action.is_compute for action in slots)
    expected = _expected(num_stages, num_microbatches, lowered=lowered)
    for action, cell in slots.items():
        if action not in expected:
            _fail(
                f"rank {cell[0]} runs {action}, {_why_unexpected(action, num_microbatches)}",
                schedule,
                marks=[cell],
            )
    for action in sorted(expected, key=_sort_key):
        if action not in slots:
            rank = action.stage_index
            _fail(
                f"rank {rank} never runs {action}: expected exactly one F and one B per "
                f"micro-batch 0..{num_microbatches - 1} on every stage"
                + (", and the sends and receives `lower` adds" if lowered else ""),
                schedule,
                mark_rows=[rank],
            )
    for before, after, rule in _PROGRAM_ORDER:
        for action, (rank, slot) in slots.items():
            if action.kind is not after:
                continue
            partner = Action(action.stage_index, before, action.microbatch_index)
            if partner in slots and slots[partner][1] > slot:
                _fail(
                    f"rank {rank} runs {action} before {partner}: expected {rule}",
                    schedule,
                    marks=[(rank, slot), slots[partner]],
                )
    _check_pairing(schedule, slots, num_stages, lowered=lowered)
    simulate(schedule)


def simulate(schedule: _ScheduleIn) -> list[list[Action | None]]:
    """Time-step grid ``grid[rank][step]`` of F and B actions (``None`` = idle); see
    [Note: time model]. Sends and receives take no time and do not appear.

    Raises `ScheduleError` on deadlock, with the grid so far and the blocked actions marked.
    """
    num_stages = num_stages_of(schedule)
    programs = [[a for a in schedule[rank] if a is not None] for rank in range(num_stages)]
    done: dict[Action, int] = {}  # action -> time it completed
    cursors = [0] * num_stages
    grid: list[list[Action | None]] = [[] for _ in range(num_stages)]
    remaining = sum(len(program) for program in programs)
    step = 0
    while remaining:
        progressed = False
        changed = True
        while changed:  # communication is instantaneous: run it to a fixed point
            changed = False
            for rank, program in enumerate(programs):
                while cursors[rank] < len(program):
                    action = program[cursors[rank]]
                    if action.is_compute or not _ready(action, done, step, num_stages):
                        break
                    done[action] = step
                    cursors[rank] += 1
                    remaining -= 1
                    changed = progressed = True
        for rank, program in enumerate(programs):
            cell = program[cursors[rank]] if cursors[rank] < len(program) else None
            if cell is None or not cell.is_compute or not _ready(cell, done, step, num_stages):
                grid[rank].append(None)
                continue
            done[cell] = step + 1
            cursors[rank] += 1
            remaining -= 1
            progressed = True
            grid[rank].append(cell)
        if not progressed:
            _deadlock(programs, cursors, done, grid, step, num_stages)
        step += 1
    while grid[0] and all(row[-1] is None for row in grid):  # trailing communication-only step
        for row in grid:
            row.pop()
    return grid


def _dependencies(action: Action, num_stages: int) -> list[Action]:
    stage, i = action.stage_index, action.microbatch_index
    match action.kind:
        case ActionKind.F:
            return [Action(stage - 1, ActionKind.F, i)] if stage > 0 else []
        case ActionKind.B:
            deps = [Action(stage, ActionKind.F, i)]
            if stage < num_stages - 1:
                deps.append(Action(stage + 1, ActionKind.B, i))
            return deps
        case ActionKind.RECV_F:
            return [Action(stage - 1, ActionKind.SEND_F, i)] if stage > 0 else []
        case ActionKind.RECV_B:
            return [Action(stage + 1, ActionKind.SEND_B, i)]
        case _:
            return []


def _ready(action: Action, done: Mapping[Action, int], step: int, num_stages: int) -> bool:
    return all(done.get(dep, step + 1) <= step for dep in _dependencies(action, num_stages))


def _deadlock(
    programs: Sequence[Sequence[Action]],
    cursors: Sequence[int],
    done: Mapping[Action, int],
    grid: list[list[Action | None]],
    step: int,
    num_stages: int,
) -> NoReturn:
    waits: list[str] = []
    marks: list[_Cell] = []
    for rank, program in enumerate(programs):
        if cursors[rank] < len(program):
            action = program[cursors[rank]]
            missing = [str(d) for d in _dependencies(action, num_stages) if d not in done]
            waits.append(f"rank {rank} waits at {action} for {' and '.join(missing) or '?'}")
            grid[rank][step] = action
            marks.append((rank, step))
    raise ScheduleError(
        f"schedule deadlocks at step {step}: {'; '.join(waits)} (blocked actions marked !)\n"
        + format_grid(dict(enumerate(grid)), axis="step", marks=marks)
    )


def _slots(schedule: _ScheduleIn) -> dict[Action, _Cell]:
    """Action -> (rank, slot), failing on foreign objects, wrong stages and duplicates."""
    slots: dict[Action, _Cell] = {}
    for rank in sorted(schedule):
        for slot, action in enumerate(schedule[rank]):
            if action is None:
                continue
            if not isinstance(action, Action):
                _fail(
                    f"rank {rank} slot {slot} holds {action!r}: expected an Action or None "
                    "(use Action.parse for strings)",
                    schedule,
                    marks=[(rank, slot)],
                )
            if action.stage_index != rank:
                _fail(
                    f"rank {rank} runs {action} of stage {action.stage_index}: expected "
                    f"stage_index == rank (one stage per rank)",
                    schedule,
                    marks=[(rank, slot)],
                )
            if action in slots:
                _fail(
                    f"rank {rank} runs {action} twice (slots {slots[action][1]} and {slot}): "
                    "expected each action exactly once",
                    schedule,
                    marks=[slots[action], (rank, slot)],
                )
            slots[action] = (rank, slot)
    return slots


def _expected(num_stages: int, num_microbatches: int, *, lowered: bool) -> set[Action]:
    expected: set[Action] = set()
    last = num_stages - 1
    for stage in range(num_stages):
        kinds = [ActionKind.F, ActionKind.B]
        if lowered:
            kinds += [ActionKind.RECV_F, ActionKind.SEND_B] if stage > 0 else []
            kinds += [ActionKind.SEND_F, ActionKind.RECV_B] if stage < last else []
        expected |= {Action(stage, k, i) for k in kinds for i in range(num_microbatches)}
    return expected


def _why_unexpected(action: Action, num_microbatches: int) -> str:
    if action.microbatch_index >= num_microbatches:
        return f"expected micro-batch indices 0..{num_microbatches - 1}"
    if not action.is_compute:
        return (
            f"but stage {action.peer_stage} does not exist: the first stage receives no "
            "activations and the last stage no gradients"
        )
    return "which this pipeline does not have"


def _sort_key(action: Action) -> tuple[int, int, int]:
    return (action.stage_index, action.microbatch_index, list(ActionKind).index(action.kind))


def _check_pairing(
    schedule: _ScheduleIn, slots: Mapping[Action, _Cell], num_stages: int, *, lowered: bool
) -> None:
    """Messages between two ranks match in order: receiver order must equal sender order.

    For a compute-only schedule, the order of the compute actions is what `lower` turns into
    send and receive order, so the same rule applies to F and B.
    """
    send_f, recv_f, send_b, recv_b = (
        (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)
        if lowered
        else (ActionKind.F, ActionKind.F, ActionKind.B, ActionKind.B)
    )
    for stage in range(1, num_stages):
        for sender, send, receiver, recv, what in (
            (stage - 1, send_f, stage, recv_f, "activations"),
            (stage, send_b, stage - 1, recv_b, "gradients"),
        ):
            sent = _order(schedule[sender], send)
            received = _order(schedule[receiver], recv)
            for position, (a, b) in enumerate(zip(sent, received, strict=True)):
                if a.microbatch_index != b.microbatch_index:
                    _fail(
                        f"rank {receiver} takes {what} of micro-batch {b.microbatch_index} "
                        f"({b}) where rank {sender} sends micro-batch {a.microbatch_index} "
                        f"({a}) as message {position}: point-to-point messages between two "
                        "ranks match in order, so both must use the same micro-batch order",
                        schedule,
                        marks=[slots[a], slots[b]],
                    )


def _order(actions: Sequence[Action | None], kind: ActionKind) -> list[Action]:
    return [a for a in actions if a is not None and a.kind is kind]


def _fail(
    summary: str,
    schedule: _ScheduleIn,
    *,
    marks: Collection[_Cell] = (),
    mark_rows: Collection[int] = (),
) -> NoReturn:
    grid = format_grid(schedule, axis="slot", marks=marks, mark_rows=mark_rows)
    raise ScheduleError(f"invalid pipeline schedule: {summary}\n{grid}")
