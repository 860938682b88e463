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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from polytrain.errors import PlanError
from polytrain.pipeline.schedule import ActionKind, Schedule, build, lower

__all__ = ["PipelineTiming", "pipeline_step", "program", "simulate_program"]


@dataclass(frozen=True)
class PipelineTiming:
    makespan: float  # seconds from the first action to the last
    busy: tuple[float, ...]  # compute seconds per stage
    per_step: float  # seconds per optimizer step (the makespan, or PipeDream's steady state)

    @property
    def bubble(self) -> float:
        """Idle seconds of the busiest stage (waiting for peers and messages)."""
        return max(0.0, self.per_step - max(self.busy, default=0.0))


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
    arrival: dict[tuple[ActionKind, int, int], float] = {}  # (kind, receiving stage, mb) -> t
    link_free: dict[tuple[int, int], float] = {}
    programs = [[a for a in program[r] if a is not None] for r in range(p)]
    remaining = sum(len(x) for x in programs)
    while remaining:
        progressed = False
        for r in range(p):
            while cursors[r] < len(programs[r]):
                a = programs[r][cursors[r]]
                kind, i = a.kind, a.microbatch_index
                if kind is ActionKind.F or kind is ActionKind.B:
                    secs = fwd_s[r] if kind is ActionKind.F else bwd_s[r]
                    clocks[r] += secs
                    busy[r] += secs
                elif kind is ActionKind.SEND_F or kind is ActionKind.SEND_B:
                    peer = r + 1 if kind is ActionKind.SEND_F else r - 1
                    secs = send_f_s[r] if kind is ActionKind.SEND_F else send_b_s[r]
                    start = max(clocks[r], link_free.get((r, peer), 0.0))
                    link_free[(r, peer)] = start + secs
                    recv = ActionKind.RECV_F if kind is ActionKind.SEND_F else ActionKind.RECV_B
                    arrival[(recv, peer, i)] = start + secs
                else:  # a receive: wait for its message
                    t = arrival.get((kind, r, i))
                    if t is None:
                        break
                    clocks[r] = max(clocks[r], t)
                cursors[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PlanError("pipeline simulation deadlocked: the schedule is not runnable")
    return max(clocks), tuple(busy)


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
) -> PipelineTiming:
    """One step of ``schedule`` with ``num_microbatches`` micro-batches per replica.

    PipeDream never flushes: its step costs the steady-state difference between a stream of
    2m and of m micro-batches (the fill and drain are paid once per run, not per step).
    """
    p = len(fwd_s)
    args = (fwd_s, bwd_s, send_f_s, send_b_s)
    span, busy = simulate_program(program(schedule, p, num_microbatches), *args)
    if schedule != "pipedream":
        return PipelineTiming(span, busy, span)
    span2, _ = simulate_program(program(schedule, p, 2 * num_microbatches), *args)
    return PipelineTiming(span, busy, span2 - span)
