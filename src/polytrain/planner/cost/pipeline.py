"""Pipeline schedules priced by simulating the very action lists the runtime executes.

GPipe (Huang et al. 2019), 1F1B / PipeDream-flush (Narayanan et al. 2021) and PipeDream
(Narayanan et al. SOSP 2019): `schedule.build` + `schedule.lower` give each rank its program
(F, B, SEND_F, RECV_F, SEND_B, RECV_B); `simulate_program` runs them with durations.
Derivation: docs/planner.md "Pipeline".

[Note: timed simulation] Each rank runs its actions in program order on its own clock. F and B
take their stage's duration. A send is non-blocking (``isend``, as in the runtime; see
[Note: runtime assumption] in pipeline/schedule/lowering.py): it costs the sender nothing and
the message arrives one p2p time later, after any earlier message on the same directed link
(one message on the wire at a time). A receive blocks until its message has arrived. With all
p2p times zero and equal stage times this gives exactly the bubble (p-1)/(m+p-1) of GPipe and
1F1B; tests check it.

[Note: shared-core simulation] On a host with more ranks than cores ([Note: shared cores] in
cost/common.py) a stage computes faster while its peers wait than while they compute: the
cores are shared among the processes that are runnable at that instant, and a rank blocked in
a receive is not. `simulate_shared` runs the same programs on one global clock instead of one
clock per rank, as processor sharing: every F or B in progress advances at ``speed[n]`` seconds
of its priced duration per second, ``n`` the number of ranks computing at that instant (the
durations are priced with every rank computing, so ``speed[p] = 1``; fewer busy, faster).
With every speed 1 it is `simulate_program` exactly (a test checks it). The pipeline's fill and
drain, where few stages compute, run fast; its steady state, where all do, at the full
slowdown. On five benchmark runs' measurements on two kinds of 2-vCPU host (2026-11-27),
pricing every stage at the mean busy count (the model before) put gpt tiny's pp4 1F1B 5-27%
low, at the full count 4-42% high, this simulation -18..+1%: docs/planner.md "A pipeline's
shared cores".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from polytrain.errors import PlanError
from polytrain.pipeline.schedule import Action, ActionKind, Schedule, build, lower

__all__ = ["PipelineTiming", "pipeline_step", "program", "simulate_program", "simulate_shared"]


@dataclass(frozen=True)
class PipelineTiming:
    makespan: float  # seconds from the first action to the last
    busy: tuple[float, ...]  # compute seconds per stage
    per_step: float  # seconds per optimizer step (the makespan, or PipeDream's steady state)

    @property
    def bubble(self) -> float:
        """Idle seconds of the busiest stage (waiting for peers and messages)."""
        return max(0.0, self.per_step - max(self.busy, default=0.0))


class _Links:
    """The messages of one simulated run ([Note: timed simulation]): a send leaves when its
    sender reaches it and its link is free (one message on a directed link at a time) and
    arrives one p2p time later; `arrival` is when a receive's message is there (None: not
    sent yet)."""

    def __init__(self, send_f_s: Sequence[float], send_b_s: Sequence[float]) -> None:
        self.send_s = {ActionKind.SEND_F: send_f_s, ActionKind.SEND_B: send_b_s}
        self.free: dict[tuple[int, int], float] = {}
        self.arrivals: dict[tuple[ActionKind, int, int], float] = {}  # (recv, rank, mb) -> t

    def send(self, action: Action, rank: int, t: float) -> None:
        forward = action.kind is ActionKind.SEND_F
        peer = rank + 1 if forward else rank - 1
        start = max(t, self.free.get((rank, peer), 0.0))
        self.free[(rank, peer)] = end = start + self.send_s[action.kind][rank]
        recv = ActionKind.RECV_F if forward else ActionKind.RECV_B
        self.arrivals[(recv, peer, action.microbatch_index)] = end

    def arrival(self, action: Action, rank: int) -> float | None:
        return self.arrivals.get((action.kind, rank, action.microbatch_index))


def simulate_program(
    program: Schedule,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    send_f_s: Sequence[float],
    send_b_s: Sequence[float],
) -> tuple[float, tuple[float, ...]]:
    """(makespan, busy seconds per rank) of a lowered schedule; see [Note: timed simulation].

    ``send_f_s[s]``: seconds of stage ``s``'s activations to ``s + 1``; ``send_b_s[s]``: of
    stage ``s``'s input gradient to ``s - 1``.
    """
    p = len(program)
    clocks = [0.0] * p
    busy = [0.0] * p
    cursors = [0] * p
    links = _Links(send_f_s, send_b_s)
    programs = [[a for a in program[r] if a is not None] for r in range(p)]
    remaining = sum(len(x) for x in programs)
    while remaining:
        progressed = False
        for r in range(p):
            while cursors[r] < len(programs[r]):
                a = programs[r][cursors[r]]
                kind = a.kind
                if kind is ActionKind.F or kind is ActionKind.B:
                    secs = fwd_s[r] if kind is ActionKind.F else bwd_s[r]
                    clocks[r] += secs
                    busy[r] += secs
                elif kind is ActionKind.SEND_F or kind is ActionKind.SEND_B:
                    links.send(a, r, clocks[r])
                else:  # a receive: wait for its message
                    t = links.arrival(a, r)
                    if t is None:
                        break
                    clocks[r] = max(clocks[r], t)
                cursors[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PlanError("pipeline simulation deadlocked: the schedule is not runnable")
    return max(clocks), tuple(busy)


def simulate_shared(
    program: Schedule,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    send_f_s: Sequence[float],
    send_b_s: Sequence[float],
    speed: Sequence[float],
    fixed_s: Sequence[float] | None = None,
) -> tuple[float, tuple[float, ...]]:
    """`simulate_program` with the ranks' compute sharing the host's cores: [Note: shared-core
    simulation]. ``speed[n]`` (n = 1..p; ``speed[0]`` unused) is how fast an F or B advances
    while ``n`` ranks compute; the last ``fixed_s[r]`` seconds of each of rank r's F and B
    are not computing (the runtime's own waits) and take their time. Busy seconds are the wall
    seconds of the F and B."""
    p = len(program)
    programs = [[a for a in program[r] if a is not None] for r in range(p)]
    cursors = [0] * p
    work = [0.0] * p  # priced seconds left of the rank's F or B in progress
    computing = [False] * p
    ready = [0.0] * p  # a rank in a receive (or its F or B's fixed end) resumes then
    fixed = fixed_s if fixed_s is not None else [0.0] * p
    busy = [0.0] * p
    links = _Links(send_f_s, send_b_s)
    t = 0.0
    while True:
        moved = True
        while moved:  # every rank not computing runs on until it computes or waits
            moved = False
            for r in range(p):
                while not computing[r] and ready[r] <= t and cursors[r] < len(programs[r]):
                    a = programs[r][cursors[r]]
                    kind = a.kind
                    if kind is ActionKind.F or kind is ActionKind.B:
                        secs = fwd_s[r] if kind is ActionKind.F else bwd_s[r]
                        work[r] = max(secs - fixed[r], 0.0)
                        computing[r] = work[r] > 0
                        if not computing[r]:
                            ready[r], busy[r] = t + secs, busy[r] + secs
                    elif kind is ActionKind.SEND_F or kind is ActionKind.SEND_B:
                        links.send(a, r, t)
                    else:  # a receive: wait for its message
                        at = links.arrival(a, r)
                        if at is None:
                            break
                        ready[r] = max(ready[r], at)
                    cursors[r] += 1
                    moved = True
        n = sum(computing)
        rate = speed[n] if n else 1.0
        steps = [work[r] / rate for r in range(p) if computing[r]]
        steps += [ready[r] - t for r in range(p) if ready[r] > t]
        if not steps:
            if any(c < len(x) for c, x in zip(cursors, programs, strict=True)):
                raise PlanError("pipeline simulation deadlocked: the schedule is not runnable")
            return t, tuple(busy)
        dt = min(steps)
        for r in range(p):
            if computing[r]:
                busy[r] += dt
                work[r] -= dt * rate
                if work[r] <= 1e-12 * max(1.0, dt * rate):
                    work[r], computing[r] = 0.0, False
                    ready[r], busy[r] = t + dt + fixed[r], busy[r] + fixed[r]
        t += dt


@cache
def program(schedule: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The lowered action lists the runtime runs (cached: the search asks for each often)."""
    return lower(build(schedule, num_stages, num_microbatches))


def pipeline_step(
    schedule: str,
    num_microbatches: int,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    send_f_s: Sequence[float],
    send_b_s: Sequence[float],
    speed: Sequence[float] | None = None,
    fixed_s: Sequence[float] | None = None,
) -> PipelineTiming:
    """One step of ``schedule`` with ``num_microbatches`` micro-batches per replica; with
    ``speed``, its ranks share the host's cores, each F and B's last ``fixed_s`` not computing
    ([Note: shared-core simulation], `simulate_shared`).

    PipeDream never flushes: its step costs the steady-state difference between a stream of
    2m and of m micro-batches (the fill and drain are paid once per run, not per step).
    """
    p = len(fwd_s)
    args = (fwd_s, bwd_s, send_f_s, send_b_s)

    def run(m: int) -> tuple[float, tuple[float, ...]]:
        if speed is None:
            return simulate_program(program(schedule, p, m), *args)
        return simulate_shared(program(schedule, p, m), *args, speed, fixed_s)

    span, busy = run(num_microbatches)
    if schedule != "pipedream":
        return PipelineTiming(span, busy, span)
    span2, _ = run(2 * num_microbatches)
    return PipelineTiming(span, busy, span2 - span)
