"""Pipeline schedules as data: the action IR, generators, lowering, validation and rendering.

GPipe (Huang et al. 2019), PipeDream-flush / 1F1B (Narayanan et al. 2021), asynchronous
PipeDream with weight stashing (Narayanan et al. SOSP 2019), interleaved 1F1B (Narayanan et al.
SC'21) and the zero-bubble ZB-H1 and ZBV (Qi et al. ICLR 2024). Pure Python, no torch: the
planner and the tests use the same schedule objects the runtime interprets.

Typical use::

    schedule = build("1f1b", num_stages=4, num_microbatches=8)   # rank -> [Action, ...]
    validate(schedule, 4, 8)
    program = lower(schedule)[rank]                             # what rank `rank` runs
    print(render(schedule))                                     # rank x step picture

    schedule, stage_map = build_next("zbv", num_ranks=4, num_microbatches=8)
    validate(schedule, 4, 8, stage_map=stage_map)
    program = lower(schedule, stage_map=stage_map)[rank]

[Note: schedules with a stage map] `SCHEDULE_NAMES` are the values of ``pipeline.schedule``,
and every one of them runs in `pipeline.runtime`. GPipe, 1F1B and PipeDream place one stage
per rank and `build` returns them alone; interleaved 1F1B, ZB-H1 and ZBV
(`NEXT_SCHEDULE_NAMES`) come from `build_next` with their `StageMap`. `build_staged` builds
any of them with its map, and `stages_per_rank` says how many stages a rank holds, which is
what the runtime partitions the model by.
"""

from __future__ import annotations

from collections.abc import Callable

from polytrain.errors import ScheduleError
from polytrain.pipeline.schedule.action import Action, ActionKind, Schedule, check_sizes
from polytrain.pipeline.schedule.formulas import (
    interleaved_bubble_ratio,
    interleaved_peak_activations,
    one_f_one_b_idle_time,
    zb_h1_idle_time,
    zb_h1_peak_activations,
    zbv_idle_steps,
    zbv_peak_activations,
)
from polytrain.pipeline.schedule.gpipe import gpipe
from polytrain.pipeline.schedule.interleaved import interleaved_1f1b, interleaved_stage_map
from polytrain.pipeline.schedule.lowering import P2PMessage, lower, p2p_message
from polytrain.pipeline.schedule.one_f_one_b import one_f_one_b
from polytrain.pipeline.schedule.pipedream import (
    max_in_flight,
    pipedream,
    stash_bound,
    weight_version,
)
from polytrain.pipeline.schedule.render import (
    bubble_fraction,
    peak_activation_memory,
    peak_activations,
    render,
    simulated_bubble_fraction,
    simulated_bubble_ratio,
)
from polytrain.pipeline.schedule.stage_map import StageMap, StageStyle
from polytrain.pipeline.schedule.validate import (
    DEFAULT_DURATIONS,
    ZERO_BUBBLE_DURATIONS,
    Durations,
    simulate,
    validate,
)
from polytrain.pipeline.schedule.zero_bubble import zb_h1, zbv, zbv_stage_map
from polytrain.pipeline.schedule.zero_stages import (
    ZERO_STAGE_SCHEDULES,
    first_forwards,
    last_backwards,
    zero_stages_problem,
)

__all__ = [
    "DEFAULT_DURATIONS",
    "NEXT_SCHEDULE_NAMES",
    "SCHEDULE_NAMES",
    "ZERO_BUBBLE_DURATIONS",
    "ZERO_STAGE_SCHEDULES",
    "Action",
    "ActionKind",
    "Durations",
    "P2PMessage",
    "Schedule",
    "StageMap",
    "StageStyle",
    "bubble_fraction",
    "build",
    "build_next",
    "build_staged",
    "first_forwards",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_bubble_ratio",
    "interleaved_peak_activations",
    "interleaved_stage_map",
    "last_backwards",
    "lower",
    "max_in_flight",
    "one_f_one_b",
    "one_f_one_b_idle_time",
    "p2p_message",
    "peak_activation_memory",
    "peak_activations",
    "pipedream",
    "render",
    "simulate",
    "simulated_bubble_fraction",
    "simulated_bubble_ratio",
    "stages_per_rank",
    "stash_bound",
    "validate",
    "weight_version",
    "zb_h1",
    "zb_h1_idle_time",
    "zb_h1_peak_activations",
    "zbv",
    "zbv_idle_steps",
    "zbv_peak_activations",
    "zbv_stage_map",
    "zero_stages_problem",
]

_GENERATORS: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "pipedream": pipedream,
}

NEXT_SCHEDULE_NAMES: tuple[str, ...] = ("interleaved-1f1b", "zb-h1", "zbv")
"""Schedules `build_next` makes, with their `StageMap`: [Note: schedules with a stage map]."""

SCHEDULE_NAMES: tuple[str, ...] = (*_GENERATORS, *NEXT_SCHEDULE_NAMES)
"""Valid values of ``pipeline.schedule``."""


def build(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The compute-only schedule called ``name`` (one of `SCHEDULE_NAMES`)."""
    generator = _GENERATORS.get(name)
    if generator is None:
        if name in NEXT_SCHEDULE_NAMES:
            raise ScheduleError(
                f"pipeline schedule {name!r} places stages with a StageMap: build it with "
                "build_next() or build_staged()"
            )
        raise ScheduleError(
            f"unknown pipeline schedule {name!r}: expected one of {', '.join(SCHEDULE_NAMES)}; "
            "set pipeline.schedule to one of them"
        )
    check_sizes(num_stages, num_microbatches)
    return generator(num_stages, num_microbatches)


_VIRTUAL_STAGES = {"zb-h1": 1, "zbv": 2}  # fixed by the schedule; interleaved takes any v


def build_next(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    *,
    virtual_stages: int | None = None,
) -> tuple[Schedule, StageMap]:
    """The compute-only schedule ``name`` (one of `NEXT_SCHEDULE_NAMES`) and its `StageMap`.

    ``virtual_stages`` is required for ``"interleaved-1f1b"`` and may only repeat the fixed
    count of the others (1 for ZB-H1, 2 for ZBV).
    """
    check_sizes(num_ranks, num_microbatches)
    if name == "interleaved-1f1b":
        if virtual_stages is None:
            raise ScheduleError(
                "interleaved-1f1b needs virtual_stages (model chunks per rank): pass "
                "virtual_stages=2 or more"
            )
        schedule = interleaved_1f1b(num_ranks, num_microbatches, virtual_stages)
        return schedule, interleaved_stage_map(num_ranks, virtual_stages)
    fixed = _VIRTUAL_STAGES.get(name)
    if fixed is None:
        raise ScheduleError(
            f"unknown next pipeline schedule {name!r}: expected one of "
            f"{', '.join(NEXT_SCHEDULE_NAMES)}"
            + (f" ({name!r} is built by build())" if name in SCHEDULE_NAMES else "")
        )
    if virtual_stages not in (None, fixed):
        raise ScheduleError(
            f"virtual_stages = {virtual_stages!r}: {name} has {fixed} stage(s) per rank; "
            "leave virtual_stages unset"
        )
    if name == "zb-h1":
        return zb_h1(num_ranks, num_microbatches), StageMap(num_ranks)
    return zbv(num_ranks, num_microbatches), zbv_stage_map(num_ranks)


def stages_per_rank(name: str, virtual_stages: int = 1) -> int:
    """Stages (model chunks) each rank holds under schedule ``name``: ``virtual_stages`` for
    interleaved 1F1B, 2 for ZBV, 1 for the others (``virtual_stages`` is then not read)."""
    if name == "interleaved-1f1b":
        return virtual_stages
    return _VIRTUAL_STAGES.get(name, 1)


def build_staged(
    name: str, num_ranks: int, num_microbatches: int, *, virtual_stages: int = 1
) -> tuple[Schedule, StageMap]:
    """Any schedule of `SCHEDULE_NAMES` with its `StageMap` (one stage per rank for `build`'s);
    ``virtual_stages`` is read by interleaved 1F1B only."""
    if name in NEXT_SCHEDULE_NAMES:
        v = virtual_stages if name == "interleaved-1f1b" else None
        return build_next(name, num_ranks, num_microbatches, virtual_stages=v)
    return build(name, num_ranks, num_microbatches), StageMap(num_ranks)
