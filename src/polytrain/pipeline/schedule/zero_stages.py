"""ZeRO inside pipeline stages, as schedule data: which schedules it runs with, and which
actions of a rank's program gather or reduce a stage's parameters.

Pure (no torch): the runtime's pre-flight (`pipeline.checks.check_zero_stages`) and its
sharded stages (`pipeline.sharded`) read it, and so does the planner, which prices and searches
exactly the layouts this module accepts ([Note: ZeRO inside stages] in pipeline/sharded.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from polytrain.pipeline.schedule.action import Action, ActionKind

__all__ = ["ZERO_STAGE_SCHEDULES", "first_forwards", "last_backwards", "zero_stages_problem"]

ZERO_STAGE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b")
"""The schedules whose stages run ZeRO: a synchronous step, each backward whole."""


def zero_stages_problem(zero: int, schedule: str, tp: int, pp: int) -> str | None:
    """Why ZeRO stage ``zero`` cannot run inside the stages of a ``pp``-stage ``schedule``
    with tensor-parallel degree ``tp`` (one line with the fix), or None when it can (or when
    there is no ZeRO or no pipeline): PipeDream stashes whole copies of a stage's weights,
    the zero-bubble schedules split each backward in two, and ZeRO stages are not
    tensor-parallel."""
    if not zero or pp < 2:
        return None
    if schedule == "pipedream":
        return (
            f"parallel.zero = {zero} with pipeline.schedule = 'pipedream': weight stashing "
            "keeps whole copies of a stage's weights, which ZeRO shards; use --schedule 1f1b "
            "(or gpipe) with ZeRO, or --zero 0 with pipedream"
        )
    if schedule not in ZERO_STAGE_SCHEDULES:
        return (
            f"parallel.zero = {zero} with pipeline.schedule = {schedule!r}: the zero-bubble "
            "schedules split each backward in two, which ZeRO stages do not; use gpipe, 1f1b "
            "or interleaved-1f1b, or --zero 0"
        )
    if tp > 1:
        return (
            f"parallel.zero = {zero} with parallel.tp = {tp} and parallel.pp = {pp}: "
            "ZeRO stages are not tensor-parallel; use tp = 1, or --zero 0"
        )
    return None


def last_backwards(program: Iterable[Action | None]) -> dict[int, int]:
    """Stage index -> micro-batch of its last ``B`` in one rank's ``program``: the backward
    after which the stage reduce-scatters its gradients (and ZeRO-2 reshards)."""
    return {
        a.stage_index: a.microbatch_index
        for a in program
        if a is not None and a.kind is ActionKind.B
    }


def first_forwards(program: Iterable[Action | None]) -> dict[int, int]:
    """Stage index -> micro-batch of its first ``F`` in one rank's ``program``: the forward
    in which ZeRO-2 gathers the stage's parameters, kept whole until its last backward."""
    first: dict[int, int] = {}
    for a in program:
        if a is not None and a.kind is ActionKind.F:
            first.setdefault(a.stage_index, a.microbatch_index)
    return first
