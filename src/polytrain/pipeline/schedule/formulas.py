"""Closed forms of the bubbles and activation peaks of interleaved 1F1B (Narayanan et al. SC'21)
and the zero-bubble schedules (Qi et al. ICLR 2024), one home for each.

Every expression here is checked against the simulated grid by the tests
(tests/unit/test_schedule_interleaved.py, test_schedule_zero_bubble.py), under the time model
of `validate` ([Note: time model]). Units: an activation is one micro-batch's activations of one
virtual stage (one model chunk); a time is in the units of ``t_f``, ``t_i``, ``t_w``.
GPipe's and 1F1B's ``(p - 1) / (m + p - 1)`` is `render.bubble_fraction`.
"""

from __future__ import annotations

from polytrain.pipeline.schedule.action import check_count

__all__ = [
    "interleaved_bubble_ratio",
    "interleaved_peak_activations",
    "one_f_one_b_idle_time",
    "zb_h1_idle_time",
    "zb_h1_peak_activations",
    "zbv_idle_steps",
    "zbv_peak_activations",
]


def interleaved_bubble_ratio(num_ranks: int, num_microbatches: int, virtual_stages: int) -> float:
    """Bubble over ideal time of interleaved 1F1B: ``(p - 1) / (v m)`` (SC'21, section 2.2.2).

    Measured as idle over busy steps of the simulated grid; exact for every ``m`` the generator
    accepts, with a chunk's B equal to its F or twice it. ``v = 1`` is 1F1B's ``(p - 1) / m``.
    """
    _check(num_ranks, num_microbatches, virtual_stages)
    return (num_ranks - 1) / (virtual_stages * num_microbatches)


def interleaved_peak_activations(
    rank: int, num_ranks: int, num_microbatches: int, virtual_stages: int
) -> int:
    """Chunk activations rank ``r`` holds at its peak: ``min(2 (p-1-r) + (v-1) p + 1, v m)``.

    Rank 0 holds ``v p + p - 1`` chunks, ``p (1 + (p - 1) / (p v))`` whole stages' worth, against
    1F1B's ``p`` (the factor of Korthikanti et al. 2022). ``v = 1``: 1F1B's ``min(p - r, m)``.
    """
    _check(num_ranks, num_microbatches, virtual_stages)
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if v == 1:
        return min(p - rank, m)
    return min(2 * (p - 1 - rank) + (v - 1) * p + 1, v * m)


def one_f_one_b_idle_time(num_ranks: int, t_f: float, t_i: float, t_w: float) -> float:
    """Idle time of every rank under 1F1B whose B takes ``t_i + t_w``: ``(p-1)(t_f+t_i+t_w)``."""
    check_count("num_ranks", num_ranks, "parallel.pp")
    return (num_ranks - 1) * (t_f + t_i + t_w)


def zb_h1_idle_time(num_ranks: int, t_f: float, t_i: float, t_w: float) -> float:
    """Idle time of every rank under ZB-H1: ``(p - 1)(t_f + t_i - t_w)`` (Qi et al. section
    2.1, whose ``T_B`` is our ``t_i``); holds for ``m >= p`` and ``t_w <= min(t_f, t_i)``.
    With equal times, a third of `one_f_one_b_idle_time`.
    """
    check_count("num_ranks", num_ranks, "parallel.pp")
    return (num_ranks - 1) * (t_f + t_i - t_w)


def zb_h1_peak_activations(num_ranks: int, num_microbatches: int) -> int:
    """Activations every rank holds at its peak under ZB-H1: ``min(p, m)``, 1F1B's first-stage
    peak (an activation counts until its W)."""
    _check(num_ranks, num_microbatches, 1)
    return min(num_ranks, num_microbatches)


def zbv_idle_steps(num_ranks: int) -> int:
    """Idle steps of every rank under ZBV with F, I and W one step per chunk and
    ``m >= 2p - 1``: ``p - 1`` whatever ``m`` (a bubble ratio of ``(p - 1) / (6 m)``), all of
    them before rank ``r``'s first action (``r``) or after its last (``p - 1 - r``)."""
    check_count("num_ranks", num_ranks, "parallel.pp")
    return num_ranks - 1


def zbv_peak_activations(num_ranks: int) -> int:
    """Chunk activations every rank holds at its peak under ZBV with ``m >= 2p - 1``: ``2 p``,
    that is ``p`` whole stages, 1F1B's first-stage peak (never more for smaller ``m``)."""
    check_count("num_ranks", num_ranks, "parallel.pp")
    return 2 * num_ranks


def _check(num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    check_count("num_ranks", num_ranks, "parallel.pp")
    check_count("num_microbatches", num_microbatches, "pipeline.microbatches")
    check_count("virtual_stages", virtual_stages, "the virtual stages per rank")
