"""Draw a pipeline schedule as a rank x step grid and measure its bubble and activation memory.

The bubble formula is GPipe's (Huang et al. 2019): with ``p`` stages and ``m`` micro-batches
the pipeline idles a fraction ``(p - 1) / (m + p - 1)`` of the time, for fill-drain and for
1F1B (PipeDream-flush, Narayanan et al. 2021) alike. `simulated_bubble_fraction` measures it on
the simulated grid instead ([Note: time model] in `validate`: F and B one step each, sends and
receives free), where GPipe and 1F1B both hit the formula exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from polytrain.pipeline.schedule._grid import format_grid
from polytrain.pipeline.schedule.action import Action, ActionKind, check_sizes
from polytrain.pipeline.schedule.validate import simulate

__all__ = ["bubble_fraction", "peak_activations", "render", "simulated_bubble_fraction"]


def render(schedule: Mapping[int, Sequence[Action | None]], *, program_order: bool = False) -> str:
    """ASCII grid of a schedule, one row per rank; ``.`` is an idle step.

    By default the columns are simulated time steps (`simulate`; sends and receives take no
    time, so they are not drawn). With ``program_order=True`` the columns are each rank's
    actions as written, sends and receives included.
    """
    if program_order:
        return format_grid(schedule, axis="slot")
    return format_grid(dict(enumerate(simulate(schedule))), axis="step")


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a synchronous pipeline: ``(p - 1) / (m + p - 1)``."""
    check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def simulated_bubble_fraction(schedule: Mapping[int, Sequence[Action | None]]) -> float:
    """Idle slots over all slots (ranks x steps) of the simulated grid; 0.0 when empty."""
    grid = simulate(schedule)
    total = len(grid) * len(grid[0])
    idle = sum(cell is None for row in grid for cell in row)
    return idle / total if total else 0.0


def peak_activations(schedule: Mapping[int, Sequence[Action | None]]) -> dict[int, int]:
    """Rank -> most micro-batches at once whose forward has run on it but not their backward.

    This is the number of micro-batches' activations the stage must hold (without
    re-materialization): ``m`` for GPipe, ``min(p - s, m)`` for 1F1B on stage ``s``.
    """
    peaks: dict[int, int] = {}
    for rank, actions in schedule.items():
        live = peak = 0
        for action in actions:
            if action is not None and action.kind is ActionKind.F:
                live += 1
                peak = max(peak, live)
            elif action is not None and action.kind is ActionKind.B:
                live -= 1
        peaks[rank] = peak
    return peaks
