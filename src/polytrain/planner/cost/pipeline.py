"""Pipeline schedules priced by simulating the very action lists the runtime executes.

GPipe (Huang et al. 2019), 1F1B / PipeDream-flush (Narayanan et al. 2021), PipeDream
(Narayanan et al. SOSP 2019), interleaved 1F1B (Narayanan et al. SC'21) and the zero-bubble
ZB-H1 and ZBV (Qi et al. ICLR 2024): `planner.schedules.lowered_program` gives each rank its
program (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B) and the `StageMap` that places the
virtual stages on ranks; `simulate_program` runs them with durations per (stage, kind).
Derivation: docs/planner.md "Pipeline".

[Note: timed simulation] Each rank runs its actions in program order on its own clock. A
compute action (F, B, I, W) takes the duration of its kind on its virtual stage. A send is
non-blocking (``isend``, as in the runtime; see [Note: runtime assumption] in
pipeline/schedule/lowering.py): it costs the sender nothing and the message arrives one p2p
time later, after any earlier message on the same channel (`P2PMessage.channel`: one direction
of one rank pair for one kind of tensor; one message on it at a time). A receive blocks until
its message has arrived. Consecutive stages on one rank (ZBV's tip) hand their tensors over
locally and free: lowering gives them no message, and the rank's program order runs the
producer first ([Note: local hand-off] there). With one stage per rank a channel is a directed
link and stage ``s`` is rank ``s``, so GPipe, 1F1B and PipeDream are priced as they were before
virtual stages (tests pin figures computed before). With all p2p times zero and equal stages
this gives exactly the bubble (p-1)/(m+p-1) of GPipe and 1F1B, interleaved 1F1B's (p-1)/(v m)
and the zero-bubble idle times of `pipeline.schedule.formulas`; tests check each.

[Note: shared-core simulation] On a host with more ranks than cores ([Note: shared cores] in
cost/common.py) a stage computes faster while its peers wait than while they compute: the
cores are shared among the processes that are runnable at that instant, and a rank blocked in
a receive is not. `simulate_shared` runs the same programs on one global clock instead of one
clock per rank, as processor sharing: every compute action in progress advances at
``speed[n]`` seconds of its priced duration per second, ``n`` the number of ranks computing at
that instant (the durations are priced with every rank computing, so ``speed[p] = 1``; fewer
busy, faster). With every speed 1 it is `simulate_program` exactly (a test checks it). The
pipeline's fill and drain, where few stages compute, run fast; its steady state, where all do,
at the full slowdown. On five benchmark runs' measurements on two kinds of 2-vCPU host,
pricing every stage at the mean busy count (the model before) put gpt tiny's pp4
1F1B 5-27% low, at the full count 4-42% high, this simulation -18..+1%: docs/planner.md "A
pipeline's shared cores".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from polytrain.errors import PlanError
from polytrain.pipeline.schedule import ActionKind, Schedule, StageMap, p2p_message
from polytrain.planner.schedules import lowered_program, stages_per_rank

__all__ = [
    "ActionComm",
    "PipelineTiming",
    "pipeline_step",
    "program",
    "simulate_program",
    "simulate_shared",
]


@dataclass(frozen=True)
class PipelineTiming:
    makespan: float  # seconds from the first action to the last
    busy: tuple[float, ...]  # compute seconds per rank
    per_step: float  # seconds per optimizer step (the makespan, or PipeDream's steady state)

    @property
    def bubble(self) -> float:
        """Idle seconds of the busiest rank (waiting for peers and messages)."""
        return max(0.0, self.per_step - max(self.busy, default=0.0))


_COMPUTE, _SEND, _RECV = 0, 1, 2
# a message: (tensor, sending stage, micro-batch); a compute action: (its kind, stage, micro-batch)
_Key = tuple[str, int, int]
# one action, ready to simulate: (what it does, its kind, its stage, its channel, its key)
_Step = tuple[int, ActionKind, int, tuple[str, int, int] | None, _Key | None]
_Steps = tuple[tuple[_Step, ...], ...]  # per rank


def _compile(program: Schedule, stage_map: StageMap) -> _Steps:
    """``program`` with each send's and receive's message resolved once (`p2p_message`)."""
    out = []
    for r in range(len(program)):
        row: list[_Step] = []
        for a in program[r]:
            if a is None:
                continue
            msg = p2p_message(a, stage_map)
            if msg is None:
                key = (a.kind.value, a.stage_index, a.microbatch_index)
                row.append((_COMPUTE, a.kind, a.stage_index, None, key))
                continue
            op = _SEND if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B) else _RECV
            key = (msg.tensor, msg.src_stage, msg.microbatch_index)
            row.append((op, a.kind, a.stage_index, msg.channel, key))
        out.append(tuple(row))
    return tuple(out)


@cache
def _compiled(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int) -> _Steps:
    return _compile(*lowered_program(schedule, num_ranks, num_microbatches, virtual_stages))


class _Links:
    """The messages of one simulated run ([Note: timed simulation]): a send leaves when its
    sender reaches it and its channel is free (one message on a channel at a time) and
    arrives one p2p time later; `arrivals` says when a message is there (absent: not sent
    yet)."""

    def __init__(self, send_f_s: Sequence[float], send_b_s: Sequence[float]) -> None:
        self.send_s = {ActionKind.SEND_F: send_f_s, ActionKind.SEND_B: send_b_s}
        self.free: dict[tuple[str, int, int], float] = {}
        self.arrivals: dict[_Key, float] = {}

    def send(self, step: _Step, t: float) -> None:
        _, kind, stage, channel, key = step
        assert channel is not None and key is not None
        start = max(t, self.free.get(channel, 0.0))
        self.free[channel] = end = start + self.send_s[kind][stage]
        self.arrivals[key] = end


def _seconds(
    steps: _Steps,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    input_s: Sequence[float] | None,
    weight_s: Sequence[float] | None,
) -> Mapping[ActionKind, Sequence[float]]:
    """Kind -> seconds per virtual stage; a split backward needs both of its halves."""
    seconds: dict[ActionKind, Sequence[float]] = {ActionKind.F: fwd_s, ActionKind.B: bwd_s}
    if input_s is not None and weight_s is not None:
        seconds[ActionKind.I], seconds[ActionKind.W] = input_s, weight_s
    elif any(step[1] in (ActionKind.I, ActionKind.W) for row in steps for step in row):
        raise PlanError(
            "the schedule splits its backward into I and W: pass input_s and weight_s "
            "(seconds of each half per stage)"
        )
    return seconds


ActionComm = Mapping[tuple[ActionKind, int, int], float]
"""(kind, stage, micro-batch) -> seconds that one compute action waits on collectives beyond
its compute (ZeRO inside stages: `cost.zero_stages`); absent actions wait on none."""


def _comm_keys(comm_s: ActionComm | None) -> dict[_Key, float]:
    return {(kind.value, s, mb): secs for (kind, s, mb), secs in (comm_s or {}).items() if secs}


# [Note: collectives in an action] A ZeRO stage's collectives (`cost.zero_stages`) are waited
# inside the action that makes them, after its input has arrived: on a CPU host FSDP2's
# collectives block the one thread ([Note: FSDP2 on a CPU host] in cost/zero.py), and on an
# accelerator the stage's root pre-forward makes FSDP2's all-gather streams wait for the
# compute stream (torch `_fsdp_state.py` `_root_pre_forward`), which already waits for the
# received activation, while a reduce-scatter follows the backward's compute and the gradient
# sent after it waits for it (`finalize_backward` on the last backward). Only ZeRO-3's gather
# before a backward may start before its gradient arrives on an accelerator (no root hook
# orders it); it is priced as waited too, a little high.


def _deadlock() -> PlanError:
    return PlanError("pipeline simulation deadlocked: the schedule is not runnable")


def simulate_program(
    program: Schedule,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    send_f_s: Sequence[float],
    send_b_s: Sequence[float],
    *,
    stage_map: StageMap | None = None,
    input_s: Sequence[float] | None = None,
    weight_s: Sequence[float] | None = None,
) -> tuple[float, tuple[float, ...]]:
    """(makespan, busy seconds per rank) of a lowered schedule; see [Note: timed simulation].

    Every sequence is indexed by virtual stage: ``fwd_s[s]``, ``bwd_s[s]`` the seconds of an F
    and a B of stage ``s``, ``input_s[s]`` and ``weight_s[s]`` of an I and a W (needed when the
    schedule splits its backward); ``send_f_s[s]`` of stage ``s``'s activations to ``s + 1``,
    ``send_b_s[s]`` of its input gradient to ``s - 1``. ``stage_map`` defaults to
    `StageMap.infer` (one stage per rank for GPipe, 1F1B and PipeDream).
    """
    stage_map = StageMap.infer(program) if stage_map is None else stage_map
    steps = _compile(program, stage_map)
    return _simulate(steps, _seconds(steps, fwd_s, bwd_s, input_s, weight_s), send_f_s, send_b_s)


def _simulate(
    steps: _Steps,
    seconds: Mapping[ActionKind, Sequence[float]],
    send_f_s: Sequence[float],
    send_b_s: Sequence[float],
    comm: Mapping[_Key, float] | None = None,
) -> tuple[float, tuple[float, ...]]:
    p = len(steps)
    clocks = [0.0] * p
    busy = [0.0] * p
    cursors = [0] * p
    links = _Links(send_f_s, send_b_s)
    remaining = sum(len(x) for x in steps)
    while remaining:
        progressed = False
        for r in range(p):
            row = steps[r]
            while cursors[r] < len(row):
                step = row[cursors[r]]
                op = step[0]
                if op == _COMPUTE:
                    secs = seconds[step[1]][step[2]]
                    if comm:  # [Note: collectives in an action]
                        secs += comm.get(step[4], 0.0)  # type: ignore[arg-type]
                    clocks[r] += secs
                    busy[r] += secs
                elif op == _SEND:
                    links.send(step, clocks[r])
                else:  # a receive: wait for its message
                    t = links.arrivals.get(step[4])  # type: ignore[arg-type]
                    if t is None:
                        break
                    clocks[r] = max(clocks[r], t)
                cursors[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise _deadlock()
    return max(clocks), tuple(busy)


def simulate_shared(
    program: Schedule,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    send_f_s: Sequence[float],
    send_b_s: Sequence[float],
    speed: Sequence[float],
    fixed_s: Sequence[float] | None = None,
    *,
    stage_map: StageMap | None = None,
    input_s: Sequence[float] | None = None,
    weight_s: Sequence[float] | None = None,
) -> tuple[float, tuple[float, ...]]:
    """`simulate_program` with the ranks' compute sharing the host's cores: [Note: shared-core
    simulation]. ``speed[n]`` (n = 1..p ranks; ``speed[0]`` unused) is how fast a compute
    action advances while ``n`` ranks compute; the last ``fixed_s[s]`` seconds of each compute
    action of stage ``s`` are not computing (the runtime's own waits) and take their time.
    Busy seconds are the wall seconds of the compute actions."""
    stage_map = StageMap.infer(program) if stage_map is None else stage_map
    steps = _compile(program, stage_map)
    seconds = _seconds(steps, fwd_s, bwd_s, input_s, weight_s)
    return _simulate_shared(steps, seconds, send_f_s, send_b_s, speed, fixed_s)


def _simulate_shared(
    steps: _Steps,
    seconds: Mapping[ActionKind, Sequence[float]],
    send_f_s: Sequence[float],
    send_b_s: Sequence[float],
    speed: Sequence[float],
    fixed_s: Sequence[float] | None,
    comm: Mapping[_Key, float] | None = None,
) -> tuple[float, tuple[float, ...]]:
    p = len(steps)
    cursors = [0] * p
    work = [0.0] * p  # priced seconds left of the rank's compute action in progress
    computing = [False] * p
    ready = [0.0] * p  # a rank in a receive (or its action's fixed end) resumes then
    tail = [0.0] * p  # the fixed end of the rank's action in progress
    busy = [0.0] * p
    links = _Links(send_f_s, send_b_s)
    t = 0.0
    while True:
        moved = True
        while moved:  # every rank not computing runs on until it computes or waits
            moved = False
            for r in range(p):
                row = steps[r]
                while not computing[r] and ready[r] <= t and cursors[r] < len(row):
                    step = row[cursors[r]]
                    op = step[0]
                    if op == _COMPUTE:
                        secs = seconds[step[1]][step[2]]
                        tail[r] = fixed_s[step[2]] if fixed_s is not None else 0.0
                        if comm:  # a collective's wait computes nothing: a fixed part
                            wait = comm.get(step[4], 0.0)  # type: ignore[arg-type]
                            secs, tail[r] = secs + wait, tail[r] + wait
                        work[r] = max(secs - tail[r], 0.0)
                        computing[r] = work[r] > 0
                        if not computing[r]:
                            ready[r], busy[r] = t + secs, busy[r] + secs
                    elif op == _SEND:
                        links.send(step, t)
                    else:  # a receive: wait for its message
                        at = links.arrivals.get(step[4])  # type: ignore[arg-type]
                        if at is None:
                            break
                        ready[r] = max(ready[r], at)
                    cursors[r] += 1
                    moved = True
        n = sum(computing)
        rate = speed[n] if n else 1.0
        waits = [work[r] / rate for r in range(p) if computing[r]]
        waits += [ready[r] - t for r in range(p) if ready[r] > t]
        if not waits:
            if any(c < len(x) for c, x in zip(cursors, steps, strict=True)):
                raise _deadlock()
            return t, tuple(busy)
        dt = min(waits)
        for r in range(p):
            if computing[r]:
                busy[r] += dt
                work[r] -= dt * rate
                if work[r] <= 1e-12 * max(1.0, dt * rate):
                    work[r], computing[r] = 0.0, False
                    ready[r], busy[r] = t + dt + tail[r], busy[r] + tail[r]
        t += dt


def program(schedule: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The lowered action lists the runtime runs for a one-stage-per-rank ``schedule``
    (`planner.schedules.lowered_program` has every schedule, with its stage map)."""
    return lowered_program(schedule, num_stages, num_microbatches)[0]


def pipeline_step(
    schedule: str,
    num_microbatches: int,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    send_f_s: Sequence[float],
    send_b_s: Sequence[float],
    speed: Sequence[float] | None = None,
    fixed_s: Sequence[float] | None = None,
    *,
    virtual_stages: int = 1,
    input_s: Sequence[float] | None = None,
    weight_s: Sequence[float] | None = None,
    comm_s: ActionComm | None = None,
) -> PipelineTiming:
    """One step of ``schedule`` with ``num_microbatches`` micro-batches per replica, every
    sequence indexed by virtual stage (`simulate_program`; as many stages as ``fwd_s`` has, on
    ``len(fwd_s) / stages per rank`` ranks); with ``speed``, its ranks share the host's cores,
    each compute action's last ``fixed_s`` not computing ([Note: shared-core simulation],
    `simulate_shared`). ``virtual_stages``: interleaved 1F1B's ``v``. ``comm_s``: seconds
    single actions wait on collectives beyond their compute (`ActionComm`, [Note: collectives
    in an action]), not computing.

    PipeDream never flushes: its step costs the steady-state difference between a stream of
    2m and of m micro-batches (the fill and drain are paid once per run, not per step).
    """
    per_rank = stages_per_rank(schedule, virtual_stages)
    if len(fwd_s) % per_rank:
        raise PlanError(
            f"{len(fwd_s)} stage durations for {schedule}, which holds {per_rank} stages per "
            f"rank: expected a multiple of {per_rank}"
        )
    p = len(fwd_s) // per_rank
    comm = _comm_keys(comm_s)

    def run(m: int) -> tuple[float, tuple[float, ...]]:
        steps = _compiled(schedule, p, m, virtual_stages)
        seconds = _seconds(steps, fwd_s, bwd_s, input_s, weight_s)
        if speed is None:
            return _simulate(steps, seconds, send_f_s, send_b_s, comm)
        return _simulate_shared(steps, seconds, send_f_s, send_b_s, speed, fixed_s, comm)

    span, busy = run(num_microbatches)
    if schedule != "pipedream":
        return PipelineTiming(span, busy, span)
    span2, _ = run(2 * num_microbatches)
    return PipelineTiming(span, busy, span2 - span)
