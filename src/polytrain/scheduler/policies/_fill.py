"""The one greedy rule the rigid policies share: walk jobs in priority order, give each its devices.

FIFO, SRTF, Tiresias and Gandiva differ only in the order they walk and in whether a job that
does not fit stops the walk (head-of-line blocking) or is skipped (backfill); the filling
itself lives here once.
"""

from __future__ import annotations

from collections.abc import Iterable

from polytrain.scheduler.jobs import JobView

__all__ = ["fill"]


def fill(
    order: Iterable[JobView],
    free: int,
    *,
    backfill: bool = True,
    start: dict[str, int] | None = None,
) -> dict[str, int]:
    """Give each job in ``order`` its requested ``devices`` while ``free`` devices last.

    A job that does not fit is skipped (``backfill``) or ends the walk (head-of-line
    blocking). ``start`` holds allocations already decided; they are kept and not re-counted.
    """
    out = dict(start or {})
    for job in order:
        if free <= 0:
            break
        if job.devices <= free:
            out[job.id] = job.devices
            free -= job.devices
        elif not backfill:
            break
    return out
