"""Pipeline schedules as data: the action IR, generators, lowering, validation and rendering.

GPipe (Huang et al. 2019), PipeDream-flush / 1F1B (Narayanan et al. 2021) and asynchronous
PipeDream with weight stashing (Narayanan et al. SOSP 2019). Pure Python, no torch: the planner
and the tests use the same schedule objects the runtime interprets.

Typical use::

    schedule = build("1f1b", num_stages=4, num_microbatches=8)   # rank -> [Action, ...]
    validate(schedule, 4, 8)
    program = lower(schedule)[rank]                             # what rank `rank` runs
    print(render(schedule))                                     # rank x step picture
"""

from __future__ import annotations

from collections.abc import Callable

from polytrain.errors import ScheduleError
from polytrain.pipeline.schedule.action import Action, ActionKind, Schedule, check_sizes
from polytrain.pipeline.schedule.gpipe import gpipe
from polytrain.pipeline.schedule.lowering import lower
from polytrain.pipeline.schedule.one_f_one_b import one_f_one_b
from polytrain.pipeline.schedule.pipedream import (
    max_in_flight,
    pipedream,
    stash_bound,
    weight_version,
)
from polytrain.pipeline.schedule.render import (
    bubble_fraction,
    peak_activations,
    render,
    simulated_bubble_fraction,
)
from polytrain.pipeline.schedule.validate import simulate, validate

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "ActionKind",
    "Schedule",
    "bubble_fraction",
    "build",
    "gpipe",
    "lower",
    "max_in_flight",
    "one_f_one_b",
    "peak_activations",
    "pipedream",
    "render",
    "simulate",
    "simulated_bubble_fraction",
    "stash_bound",
    "validate",
    "weight_version",
]

_GENERATORS: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "pipedream": pipedream,
}

SCHEDULE_NAMES: tuple[str, ...] = tuple(_GENERATORS)
"""Valid values of ``pipeline.schedule``."""


def build(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The compute-only schedule called ``name`` (one of `SCHEDULE_NAMES`)."""
    generator = _GENERATORS.get(name)
    if generator is None:
        raise ScheduleError(
            f"unknown pipeline schedule {name!r}: expected one of {', '.join(SCHEDULE_NAMES)}; "
            "set pipeline.schedule to one of them"
        )
    check_sizes(num_stages, num_microbatches)
    return generator(num_stages, num_microbatches)
