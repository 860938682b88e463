"""Check a pipeline schedule and simulate it step by step (GPipe, Huang et al. 2019; PipeDream,
Narayanan et al. SOSP 2019 and 2021; interleaved 1F1B, Narayanan et al. SC'21; zero bubble,
Qi et al. ICLR 2024).

`validate` checks counts, per-rank order, the pairing of sends and receives, and that the
schedule runs to the end; a failure raises `ScheduleError` whose first line is the summary and
whose next lines are a rank x slot (program order) or rank x step (simulated time) grid with the
offending rank marked ``>>`` and the offending cells marked ``!``.

[Note: time model] `simulate` runs all ranks in lock-step. A compute action takes a whole
number of steps, ``durations[kind]`` (default one step each for F, B, I and W; the zero-bubble
paper's analysis uses `ZERO_BUBBLE_DURATIONS`: F = I = W = 1, B = I + W = 2); sends and receives
take no time. At each step, first every send and receive that can run does (repeatedly, so a
receive matches a send posted in the same instant; a rank busy computing does not), then every
idle rank whose next action is a compute action whose dependencies completed before this step
starts it. Dependencies, for stage ``s`` of ``S`` virtual stages:

* ``sF i`` needs ``(s-1)F i``;
* ``sB i`` and ``sI i`` need ``sF i`` and, unless ``s`` is the last stage, the gradient from
  ``s+1``: ``(s+1)I i`` if the schedule splits that backward, else ``(s+1)B i``;
* ``sW i`` needs ``sI i`` (and nothing from other stages);
* ``sRECV_F i`` needs ``(s-1)SEND_F i`` and ``sRECV_B i`` needs ``(s+1)SEND_B i``;
* sends need nothing but their place in program order (non-blocking ``isend``; see
  [Note: runtime assumption] in `lowering`).

Dependencies are on stages, not ranks: two stages on one rank hand their tensors over locally,
and the same rules order them. Each rank runs its actions strictly in program order. Hence a
lowered schedule simulates to the same grid as its compute-only source, and a schedule runs to
the end iff it cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import NoReturn

from polytrain.errors import ScheduleError
from polytrain.pipeline.schedule._grid import format_grid
from polytrain.pipeline.schedule.action import Action, ActionKind, check_count
from polytrain.pipeline.schedule.lowering import p2p_message
from polytrain.pipeline.schedule.stage_map import StageMap

__all__ = ["DEFAULT_DURATIONS", "ZERO_BUBBLE_DURATIONS", "Durations", "simulate", "validate"]

Durations = Mapping[ActionKind, int]
"""Steps each compute kind takes in `simulate`; kinds left out take one step."""

DEFAULT_DURATIONS: Durations = {kind: 1 for kind in ActionKind if Action(0, kind, 0).is_compute}
"""One step per F, B, I and W: GPipe's and 1F1B's unit grid."""

ZERO_BUBBLE_DURATIONS: Durations = {
    ActionKind.F: 1,
    ActionKind.B: 2,
    ActionKind.I: 1,
    ActionKind.W: 1,
}
"""The zero-bubble paper's analysis: ``T_F = T_B = T_W`` (its B is our I), so a full B is 2."""

_ScheduleIn = Mapping[int, Sequence[Action | None]]
_Cell = tuple[int, int]

# (earlier kind, later kind, same-rank rule) pairs for one micro-batch, and why.
_PROGRAM_ORDER = (
    (ActionKind.F, ActionKind.B, "each backward after the forward of its micro-batch"),
    (ActionKind.F, ActionKind.I, "each backward after the forward of its micro-batch"),
    (ActionKind.I, ActionKind.W, "the weight gradient after the input gradient"),
    (ActionKind.RECV_F, ActionKind.F, "the activations received before the forward"),
    (ActionKind.F, ActionKind.SEND_F, "the activations sent after the forward"),
    (ActionKind.RECV_B, ActionKind.B, "the gradient received before the backward"),
    (ActionKind.RECV_B, ActionKind.I, "the gradient received before the backward"),
    (ActionKind.B, ActionKind.SEND_B, "the gradient sent after the backward"),
    (ActionKind.I, ActionKind.SEND_B, "the gradient sent after the backward"),
)
_BACKWARDS = (ActionKind.B, ActionKind.I)  # produce the gradient sent to the previous stage


def validate(
    schedule: _ScheduleIn,
    num_ranks: int,
    num_microbatches: int,
    *,
    stage_map: StageMap | None = None,
) -> None:
    """Raise `ScheduleError` with a grid unless ``schedule`` is a correct pipeline schedule.

    ``stage_map`` places the virtual stages on the ``num_ranks`` ranks (default: one stage per
    rank). Compute-only and lowered (`lower`) schedules are both accepted; a schedule is lowered
    when it has any send or receive, and then it must have exactly the ones `lower` would add.
    Each micro-batch's backward on each stage is one B or an I and a W.
    """
    check_count("num_ranks", num_ranks, "parallel.pp")
    check_count("num_microbatches", num_microbatches, "pipeline.microbatches")
    stage_map = StageMap(num_ranks) if stage_map is None else stage_map
    if stage_map.num_ranks != num_ranks:
        raise ScheduleError(
            f"stage_map has {stage_map.num_ranks} ranks where num_ranks = {num_ranks}: "
            "expected the map of this pipeline"
        )
    if set(schedule) != set(range(num_ranks)):
        _fail(
            f"schedule has ranks {sorted(schedule)}: expected ranks 0..{num_ranks - 1} "
            + (
                f"(one stage per rank for {num_ranks} stages)"
                if stage_map.stages_per_rank == 1
                else f"({stage_map.describe()})"
            ),
            schedule,
        )
    slots = _slots(schedule, stage_map)
    lowered = any(not action.is_compute for action in slots)
    expected = _expected(slots, stage_map, num_microbatches, lowered=lowered)
    for action, cell in slots.items():
        if action not in expected:
            _fail(
                f"rank {cell[0]} runs {action}, "
                + _why_unexpected(action, slots, stage_map, num_microbatches),
                schedule,
                marks=[cell],
            )
    for action in sorted(expected, key=_sort_key):
        if action not in slots:
            rank = stage_map.rank_of(action.stage_index)
            _fail(
                f"rank {rank} never runs {action}: expected exactly one F and either one B or "
                f"one I and one W per micro-batch 0..{num_microbatches - 1} on every stage"
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
    _check_pairing(schedule, slots, stage_map, lowered=lowered)
    simulate(schedule, stage_map=stage_map)


def simulate(
    schedule: _ScheduleIn,
    *,
    stage_map: StageMap | None = None,
    durations: Durations | None = None,
) -> list[list[Action | None]]:
    """Time-step grid ``grid[rank][step]`` of compute actions (``None`` = idle); see
    [Note: time model]. An action of ``d`` steps fills ``d`` consecutive cells; sends and
    receives take no time and do not appear. ``stage_map`` defaults to `StageMap.infer`.

    Raises `ScheduleError` on deadlock, with the grid so far and the blocked actions marked.
    """
    stage_map = StageMap.infer(schedule) if stage_map is None else stage_map
    steps = {**DEFAULT_DURATIONS, **(durations or {})}
    for kind, value in steps.items():
        if kind not in DEFAULT_DURATIONS:
            raise ScheduleError(
                f"durations[{getattr(kind, 'value', kind)}] given: expected durations of F, B, I "
                "and W only (sends and receives take no time in this model)"
            )
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(
                f"durations[{kind.value}] = {value!r}: expected a whole number of steps >= 1"
            )
    num_ranks, num_stages = stage_map.num_ranks, stage_map.num_stages
    programs = [[a for a in schedule[rank] if a is not None] for rank in range(num_ranks)]
    split = {
        (a.stage_index, a.microbatch_index) for p in programs for a in p if a.kind is ActionKind.I
    }
    deps = _Dependencies(num_stages, split)
    done: dict[Action, int] = {}  # action -> time it completed
    cursors = [0] * num_ranks
    busy_until = [0] * num_ranks
    grid: list[list[Action | None]] = [[] for _ in range(num_ranks)]
    remaining = sum(len(program) for program in programs)
    step = 0
    while remaining or max(busy_until) > step:  # the last actions may still be running
        progressed = False
        changed = True
        while changed:  # communication is instantaneous: run it to a fixed point
            changed = False
            for rank, program in enumerate(programs):
                while busy_until[rank] <= step and cursors[rank] < len(program):
                    action = program[cursors[rank]]
                    if action.is_compute or not deps.ready(action, done, step):
                        break
                    done[action] = step
                    cursors[rank] += 1
                    remaining -= 1
                    changed = progressed = True
        for rank, program in enumerate(programs):
            if busy_until[rank] > step:  # still computing the action it started earlier
                grid[rank].append(grid[rank][-1])
                progressed = True
                continue
            cell = program[cursors[rank]] if cursors[rank] < len(program) else None
            if cell is None or not cell.is_compute or not deps.ready(cell, done, step):
                grid[rank].append(None)
                continue
            busy_until[rank] = done[cell] = step + steps[cell.kind]
            cursors[rank] += 1
            remaining -= 1
            progressed = True
            grid[rank].append(cell)
        if not progressed:
            _deadlock(programs, cursors, done, grid, step, deps)
        step += 1
    while grid[0] and all(row[-1] is None for row in grid):  # trailing communication-only step
        for row in grid:
            row.pop()
    return grid


class _Dependencies:
    """[Note: time model]'s dependency rules for one schedule."""

    def __init__(self, num_stages: int, split: Collection[tuple[int, int]]) -> None:
        self.num_stages = num_stages
        self.split = split  # (stage, micro-batch) whose backward is I + W

    def of(self, action: Action) -> list[Action]:
        stage, i = action.stage_index, action.microbatch_index
        match action.kind:
            case ActionKind.F:
                return [Action(stage - 1, ActionKind.F, i)] if stage > 0 else []
            case ActionKind.B | ActionKind.I:
                deps = [Action(stage, ActionKind.F, i)]
                if stage < self.num_stages - 1:
                    kind = ActionKind.I if (stage + 1, i) in self.split else ActionKind.B
                    deps.append(Action(stage + 1, kind, i))
                return deps
            case ActionKind.W:
                return [Action(stage, ActionKind.I, i)]
            case ActionKind.RECV_F:
                return [Action(stage - 1, ActionKind.SEND_F, i)] if stage > 0 else []
            case ActionKind.RECV_B:
                return [Action(stage + 1, ActionKind.SEND_B, i)]
            case _:
                return []

    def ready(self, action: Action, done: Mapping[Action, int], step: int) -> bool:
        return all(done.get(dep, step + 1) <= step for dep in self.of(action))


def _deadlock(
    programs: Sequence[Sequence[Action]],
    cursors: Sequence[int],
    done: Mapping[Action, int],
    grid: list[list[Action | None]],
    step: int,
    deps: _Dependencies,
) -> NoReturn:
    waits: list[str] = []
    marks: list[_Cell] = []
    for rank, program in enumerate(programs):
        if cursors[rank] < len(program):
            action = program[cursors[rank]]
            missing = [str(d) for d in deps.of(action) if d not in done]
            waits.append(f"rank {rank} waits at {action} for {' and '.join(missing) or '?'}")
            grid[rank][step] = action
            marks.append((rank, step))
    raise ScheduleError(
        f"schedule deadlocks at step {step}: {'; '.join(waits)} (blocked actions marked !)\n"
        + format_grid(dict(enumerate(grid)), axis="step", marks=marks)
    )


def _slots(schedule: _ScheduleIn, stage_map: StageMap) -> dict[Action, _Cell]:
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
            stage = action.stage_index
            if stage_map.stages_per_rank == 1 and stage != rank:
                _fail(
                    f"rank {rank} runs {action} of stage {stage}: expected "
                    "stage_index == rank (one stage per rank; pass stage_map for virtual stages)",
                    schedule,
                    marks=[(rank, slot)],
                )
            if stage >= stage_map.num_stages:
                _fail(
                    f"rank {rank} runs {action} of stage {stage}: expected stage indices "
                    f"0..{stage_map.num_stages - 1} ({stage_map.describe()})",
                    schedule,
                    marks=[(rank, slot)],
                )
            if stage_map.rank_of(stage) != rank:
                _fail(
                    f"rank {rank} runs {action}, but stage {stage} lives on rank "
                    f"{stage_map.rank_of(stage)} ({stage_map.describe()})",
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


def _is_split(slots: Collection[Action], stage: int, i: int) -> bool:
    return Action(stage, ActionKind.I, i) in slots or Action(stage, ActionKind.W, i) in slots


def _expected(
    slots: Collection[Action], stage_map: StageMap, num_microbatches: int, *, lowered: bool
) -> set[Action]:
    expected: set[Action] = set()
    last = stage_map.num_stages - 1
    for stage in range(stage_map.num_stages):
        comm: list[ActionKind] = []
        if lowered and stage > 0 and not stage_map.is_local(stage, stage - 1):
            comm += [ActionKind.RECV_F, ActionKind.SEND_B]
        if lowered and stage < last and not stage_map.is_local(stage, stage + 1):
            comm += [ActionKind.SEND_F, ActionKind.RECV_B]
        for i in range(num_microbatches):
            backward = (
                [ActionKind.I, ActionKind.W] if _is_split(slots, stage, i) else [ActionKind.B]
            )
            expected |= {Action(stage, k, i) for k in [ActionKind.F, *backward, *comm]}
    return expected


def _why_unexpected(
    action: Action, slots: Collection[Action], stage_map: StageMap, num_microbatches: int
) -> str:
    if action.microbatch_index >= num_microbatches:
        return f"expected micro-batch indices 0..{num_microbatches - 1}"
    if action.kind is ActionKind.B and _is_split(
        slots, action.stage_index, action.microbatch_index
    ):
        return (
            "but the schedule also splits that backward into I and W: expected either one B or "
            "one I and one W per stage and micro-batch"
        )
    if not action.is_compute:
        peer = action.peer_stage
        assert peer is not None
        if not 0 <= peer < stage_map.num_stages:
            return (
                f"but stage {peer} does not exist: the first stage receives no "
                "activations and the last stage no gradients"
            )
        return (
            f"but stage {peer} is on the same rank: stages on one rank hand tensors over "
            "locally, with no send or receive ([Note: local hand-off] in lowering)"
        )
    return "which this pipeline does not have"


def _sort_key(action: Action) -> tuple[int, int, int]:
    return (action.stage_index, action.microbatch_index, list(ActionKind).index(action.kind))


_Message = tuple[int, int]  # (sending stage, micro-batch): what a message carries
_Channel = tuple[str, int, int]  # ("activations" | "gradients", sender rank, receiver rank)


def _check_pairing(
    schedule: _ScheduleIn, slots: Mapping[Action, _Cell], stage_map: StageMap, *, lowered: bool
) -> None:
    """Messages between two ranks match in order: receiver order must equal sender order.

    A channel is one direction of one rank pair for one kind of tensor (activations or
    gradients, which the runtime keeps apart); with several stages per rank it carries several
    stages' messages, and the order over all of them must agree on both ends. For a
    compute-only schedule, the order of the compute actions is what `lower` turns into send and
    receive order, so the same rule applies to them.
    """
    sends: dict[_Channel, list[tuple[_Message, Action]]] = {}
    recvs: dict[_Channel, list[tuple[_Message, Action]]] = {}
    for rank in sorted(schedule):
        for action in schedule[rank]:
            if action is None:
                continue
            for table, channel, message in _endpoints(action, rank, stage_map, lowered=lowered):
                table_of = sends if table == "send" else recvs
                table_of.setdefault(channel, []).append((message, action))
    for channel, sent in sends.items():
        what, sender, receiver = channel
        received = recvs.get(channel, [])
        for position, ((m_sent, a), (m_taken, b)) in enumerate(zip(sent, received, strict=True)):
            if m_sent != m_taken:
                _fail(
                    f"rank {receiver} takes {what} of micro-batch {m_taken[1]}"
                    f"{_from(m_taken, stage_map)} ({b}) where rank {sender} sends micro-batch "
                    f"{m_sent[1]}{_from(m_sent, stage_map)} ({a}) as message {position}: "
                    "point-to-point messages between two ranks match in order, so both must "
                    "use the same order",
                    schedule,
                    marks=[slots[a], slots[b]],
                )


def _from(message: _Message, stage_map: StageMap) -> str:
    return f" of stage {message[0]}" if stage_map.stages_per_rank > 1 else ""


def _endpoints(
    action: Action, rank: int, stage_map: StageMap, *, lowered: bool
) -> list[tuple[str, _Channel, _Message]]:
    """The message ends ``action`` stands for: ("send" | "recv", channel, message)."""
    stage, i, kind = action.stage_index, action.microbatch_index, action.kind
    if lowered:
        message = p2p_message(action, stage_map)
        if message is None:
            return []
        end = "send" if kind in (ActionKind.SEND_F, ActionKind.SEND_B) else "recv"
        return [(end, message.channel, (message.src_stage, i))]
    last = stage_map.num_stages - 1
    ends: list[tuple[str, _Channel, _Message]] = []

    def remote(peer: int) -> bool:
        return 0 <= peer <= last and not stage_map.is_local(stage, peer)

    # A compute action stands for the messages `lower` puts around it.
    if kind is ActionKind.F and remote(stage - 1):
        ends.append(("recv", ("activations", stage_map.rank_of(stage - 1), rank), (stage - 1, i)))
    if kind is ActionKind.F and remote(stage + 1):
        ends.append(("send", ("activations", rank, stage_map.rank_of(stage + 1)), (stage, i)))
    if kind in _BACKWARDS and remote(stage + 1):
        ends.append(("recv", ("gradients", stage_map.rank_of(stage + 1), rank), (stage + 1, i)))
    if kind in _BACKWARDS and remote(stage - 1):
        ends.append(("send", ("gradients", rank, stage_map.rank_of(stage - 1)), (stage, i)))
    return ends


def _fail(
    summary: str,
    schedule: _ScheduleIn,
    *,
    marks: Collection[_Cell] = (),
    mark_rows: Collection[int] = (),
) -> NoReturn:
    grid = format_grid(schedule, axis="slot", marks=marks, mark_rows=mark_rows)
    raise ScheduleError(f"invalid pipeline schedule: {summary}\n{grid}")
