"""The pipeline schedules the planner prices: the runtime's action lists and stage maps, and
the layouts a schedule cannot run.

Every program comes from `pipeline.schedule` (GPipe, 1F1B and PipeDream through `build`;
interleaved 1F1B, Narayanan et al. SC'21, and the zero-bubble ZB-H1 and ZBV, Qi et al. ICLR
2024, through `build_next`), lowered with `lower`: the planner simulates and counts the very
lists the runtime interprets, with the `StageMap` that says which rank holds which virtual
stage. Pure Python, no torch; its own module so that `planner.memory` and `planner.cost` both
import it (the cost package imports `memory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import TypeVar

from polytrain.errors import PlanError, ScheduleError
from polytrain.pipeline.schedule import (
    NEXT_SCHEDULE_NAMES,
    SCHEDULE_NAMES,
    Schedule,
    StageMap,
    build,
    build_next,
    lower,
    zero_stages_problem,
)
from polytrain.planner.types import Layout

__all__ = [
    "PRICED_SCHEDULES",
    "by_rank",
    "check_pipeline",
    "compute_program",
    "layout_compute",
    "layout_program",
    "lowered_program",
    "pipeline_problem",
    "stages_per_rank",
]

_T = TypeVar("_T")

PRICED_SCHEDULES: tuple[str, ...] = tuple(dict.fromkeys(SCHEDULE_NAMES + NEXT_SCHEDULE_NAMES))
"""Schedules `Layout.schedule` may name: every one the runtime runs."""


@cache
def compute_program(
    schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[Schedule, StageMap]:
    """The compute action lists of ``schedule`` (rank -> F, B, I and W actions, before
    lowering) and its stage map: what memory needs (activations live from an F to its B or
    W). Cached: the search asks for each often. ``virtual_stages`` is interleaved 1F1B's
    ``v``; the other schedules fix their own (ZBV two, the rest one)."""
    try:
        if schedule not in NEXT_SCHEDULE_NAMES:  # one stage per rank (build raises if unknown)
            if virtual_stages != 1:
                raise ScheduleError(f"{schedule} has one stage per rank")
            return build(schedule, num_ranks, num_microbatches), StageMap(num_ranks)
        v = virtual_stages if schedule == "interleaved-1f1b" else None
        if v is None and virtual_stages != 1:
            raise ScheduleError(f"{schedule} fixes its own stages per rank")
        return build_next(schedule, num_ranks, num_microbatches, virtual_stages=v)
    except ScheduleError as e:
        raise PlanError(f"cannot price pipeline schedule {schedule!r}: {e}") from None


@cache
def lowered_program(
    schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[Schedule, StageMap]:
    """The lowered action lists of ``schedule`` (rank -> actions, sends and receives
    included) and its stage map: what the step time is simulated over. Cached, as
    `compute_program`, which it lowers."""
    compute, stage_map = compute_program(schedule, num_ranks, num_microbatches, virtual_stages)
    try:
        return lower(compute, stage_map=stage_map), stage_map
    except ScheduleError as e:
        raise PlanError(f"cannot price pipeline schedule {schedule!r}: {e}") from None


def stages_per_rank(schedule: str, virtual_stages: int = 1) -> int:
    """Virtual stages each rank holds under ``schedule``: its `StageMap`'s (ZBV 2, interleaved
    1F1B ``virtual_stages``, the rest 1), read off a one-rank build so that the schedule
    package stays the one home of each schedule's placement."""
    return compute_program(schedule, 1, 1, virtual_stages)[1].stages_per_rank


def layout_program(layout: Layout) -> tuple[Schedule, StageMap]:
    """`lowered_program` of a pipeline ``layout`` (``layout.pp > 1``)."""
    return lowered_program(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)


def layout_compute(layout: Layout) -> tuple[Schedule, StageMap]:
    """`compute_program` of a pipeline ``layout`` (``layout.pp > 1``): its stage map and
    activations without lowering it, which a layout that does not fit never needs."""
    return compute_program(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)


def pipeline_problem(layout: Layout, num_blocks: int) -> str | None:
    """Why pipeline ``layout``'s schedule cannot run over ``num_blocks`` blocks (one line with
    the fix), or None when it can. The search skips such layouts; `check_pipeline` refuses
    them. Beyond an unknown name and ``virtual_stages`` on a schedule that fixes its own:
    interleaved 1F1B needs ``m`` a multiple of ``p`` ([Note: interleaved micro-batch count] in
    pipeline/schedule/interleaved.py), and a schedule with several stages per rank needs at
    least a block per stage (the partition balances uneven counts, as the runtime's does); and
    ZeRO stages run with gpipe, 1f1b and interleaved 1F1B only
    (`pipeline.schedule.zero_stages_problem`, the runtime's own rule, but for its refusal of
    tensor-parallel stages: [Note: tensor-parallel ZeRO stages] in cost/zero_stages.py)."""
    p, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    zero = zero_stages_problem(layout.zero, layout.schedule, 1, p)
    if zero is not None:
        return zero
    if layout.schedule not in PRICED_SCHEDULES:
        return (
            f"unknown pipeline schedule {layout.schedule!r}: expected one of "
            f"{', '.join(PRICED_SCHEDULES)}"
        )
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        return f"virtual_stages = {v!r}: expected an integer >= 1"
    if layout.schedule != "interleaved-1f1b" and v != 1:
        return (
            f"virtual_stages = {v} with schedule {layout.schedule}: only interleaved-1f1b takes "
            "it (ZBV's two stages per rank are the schedule's own); leave it at 1"
        )
    if layout.schedule == "interleaved-1f1b" and v > 1 and m % p:
        up = (m // p + 1) * p
        return (
            f"interleaved-1f1b with pp = {p} needs micro-batches a multiple of {p}, not {m}: "
            f"use {up}" + (f" or {up - p}" if up > p else "")
        )
    if p <= 1 or layout.schedule not in NEXT_SCHEDULE_NAMES:
        return None
    stage_map = compute_program(layout.schedule, p, m, v)[1]
    stages = stage_map.num_stages
    if stage_map.stages_per_rank > 1 and num_blocks < stages:
        return (
            f"{layout.schedule} on pp = {p} runs {stages} stages and the model has "
            f"{num_blocks} blocks: use a pp x stages per rank of at most {num_blocks}"
        )
    return None


def check_pipeline(layout: Layout, num_blocks: int) -> None:
    """Raise `PlanError` (one line, `pipeline_problem`) unless the runtime can run ``layout``."""
    problem = pipeline_problem(layout, num_blocks)
    if problem is not None:
        raise PlanError(f"layout {layout.describe()}: {problem}")


def by_rank(stages: Sequence[Sequence[_T]], stage_map: StageMap) -> list[list[_T]]:
    """What each rank holds of ``stages`` (one sequence per virtual stage, model order): its
    stages' items in model order. One stage per rank: ``stages`` itself."""
    if len(stages) != stage_map.num_stages:
        raise PlanError(
            f"{len(stages)} stages for {stage_map.describe()}: expected {stage_map.num_stages}"
        )
    return [
        [item for s in stage_map.stages_of(r) for item in stages[s]]
        for r in range(stage_map.num_ranks)
    ]
