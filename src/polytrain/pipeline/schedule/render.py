"""Draw a pipeline schedule as a rank x step grid and measure its bubble and activation memory.

The bubble formula is GPipe's (Huang et al. 2019): with ``p`` stages and ``m`` micro-batches
the pipeline idles a fraction ``(p - 1) / (m + p - 1)`` of the time, for fill-drain and for
1F1B (PipeDream-flush, Narayanan et al. 2021) alike. `simulated_bubble_fraction` measures it on
the simulated grid instead ([Note: time model] in `validate`: F and B one step each, sends and
receives free), where GPipe and 1F1B both hit the formula exactly. The papers of interleaved
1F1B and zero bubble state their bubble relative to the ideal time instead (idle over busy);
`simulated_bubble_ratio` measures that, and `formulas` holds their expressions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from polytrain.pipeline.schedule._grid import format_grid
from polytrain.pipeline.schedule.action import Action, ActionKind, check_sizes
from polytrain.pipeline.schedule.stage_map import StageMap
from polytrain.pipeline.schedule.validate import Durations, simulate

__all__ = [
    "bubble_fraction",
    "peak_activation_memory",
    "peak_activations",
    "render",
    "simulated_bubble_fraction",
    "simulated_bubble_ratio",
]

_ScheduleIn = Mapping[int, Sequence[Action | None]]


def render(
    schedule: _ScheduleIn,
    *,
    program_order: bool = False,
    stage_map: StageMap | None = None,
    durations: Durations | None = None,
) -> str:
    """ASCII grid of a schedule, one row per rank; ``.`` is an idle step.

    By default the columns are simulated time steps (`simulate` with ``durations``; an action
    of ``d`` steps is drawn in ``d`` cells; sends and receives take no time, so they are not
    drawn). Each cell names its virtual stage (``"5F2"``), so interleaved and V-shaped
    schedules read directly. With ``program_order=True`` the columns are each rank's actions as
    written, sends and receives included.
    """
    if program_order:
        return format_grid(schedule, axis="slot")
    grid = simulate(schedule, stage_map=stage_map, durations=durations)
    return format_grid(dict(enumerate(grid)), axis="step")


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a synchronous pipeline: ``(p - 1) / (m + p - 1)``."""
    check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def simulated_bubble_fraction(
    schedule: _ScheduleIn,
    *,
    stage_map: StageMap | None = None,
    durations: Durations | None = None,
) -> float:
    """Idle slots over all slots (ranks x steps) of the simulated grid; 0.0 when empty."""
    idle, busy = _idle_and_busy(schedule, stage_map, durations)
    return idle / (idle + busy) if idle + busy else 0.0


def simulated_bubble_ratio(
    schedule: _ScheduleIn,
    *,
    stage_map: StageMap | None = None,
    durations: Durations | None = None,
) -> float:
    """Idle slots over busy slots of the simulated grid: the bubble relative to the ideal
    (bubble-free) time, the measure of the interleaved and zero-bubble papers; 0.0 when empty.

    For a grid of ``r`` ranks and ``t`` steps with ``i`` idle cells this is ``i / (r t - i)``;
    `simulated_bubble_fraction` is ``i / (r t)``. They relate as ``f = x / (1 + x)``.
    """
    idle, busy = _idle_and_busy(schedule, stage_map, durations)
    return idle / busy if busy else 0.0


def _idle_and_busy(
    schedule: _ScheduleIn, stage_map: StageMap | None, durations: Durations | None
) -> tuple[int, int]:
    grid = simulate(schedule, stage_map=stage_map, durations=durations)
    idle = sum(cell is None for row in grid for cell in row)
    return idle, sum(len(row) for row in grid) - idle


def peak_activations(schedule: _ScheduleIn) -> dict[int, int]:
    """Rank -> most micro-batch activations at once: forwards run on it whose backward is not.

    An activation counts from its ``F`` until its ``B``, or, for a split backward, its ``W``
    (``I`` frees part of it, ``W`` needs the stage input and output gradient, so the whole is
    charged until ``W``). With several stages per rank this counts (stage, micro-batch) pairs:
    one model chunk's activations each. ``m`` for GPipe, ``min(p - s, m)`` for 1F1B on stage
    ``s``; `formulas` has the interleaved and zero-bubble ones.
    """
    return {
        rank: int(peak)
        for rank, peak in peak_activation_memory(schedule, lambda stage: 1.0).items()
    }


def peak_activation_memory(
    schedule: _ScheduleIn, size_of: Callable[[int], float]
) -> dict[int, float]:
    """Rank -> peak of the activations it holds, in the units of ``size_of(stage_index)``
    (one micro-batch's activations on that stage, e.g. bytes); as `peak_activations`, which is
    this with every size 1. Chunks of unequal size are why the planner needs this per stage.
    """
    peaks: dict[int, float] = {}
    for rank, actions in schedule.items():
        live = peak = 0.0
        for action in actions:
            if action is None:
                continue
            if action.kind is ActionKind.F:
                live += size_of(action.stage_index)
                peak = max(peak, live)
            elif action.kind in (ActionKind.B, ActionKind.W):
                live -= size_of(action.stage_index)
        peaks[rank] = peak
    return peaks
