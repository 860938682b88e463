"""The pipeline schedules benchmark's bookkeeping without processes: the per-rank idle share,
the cost of a split backward against a full one, and the formulas it compares with."""

from __future__ import annotations

from typing import Any

import pytest
from benchmarks.pipeline import schedules as bench


def _span(rank: int, kind: str, stage: int, step: int, ts: float, dur: float) -> dict[str, Any]:
    return {"pid": rank, "name": kind, "ts": ts, "dur": dur, "args": {"stage": stage, "step": step}}


def test_rank_idle_shares_one_window_and_skips_the_warm_up() -> None:
    events = [
        [_span(0, "F", 0, 0, 0, 1), _span(0, "F", 0, 1, 0, 6), _span(0, "B", 0, 1, 6, 2)],
        [_span(1, "F", 1, 0, 0, 1), _span(1, "F", 1, 1, 2, 4), _span(1, "W", 1, 1, 6, 4)],
    ]
    # Step 1's window is 0..10: rank 0 busy 8, rank 1 busy 8 (step 0 is the warm-up).
    assert bench._rank_idle(events, skip_first=1) == pytest.approx([0.2, 0.2])


def test_split_cost_takes_b_from_a_schedule_with_the_same_partition() -> None:
    durations = {
        "1f1b": {"F": {"0": 1.0}, "B": {"0": 2.0}},
        "zb-h1": {"F": {"0": 1.0}, "I": {"0": 1.5}, "W": {"0": 1.5}},
        "zbv": {"F": {"0": 1.0}, "I": {"0": 1.0}, "W": {"0": 1.0}},
    }
    partitions = {"1f1b": [[0, 4]], "zb-h1": [[0, 4]], "zbv": [[0, 2]]}
    cost = bench._split_cost(durations, partitions)
    assert cost == {"zb-h1": {"b_from": "1f1b", "per_stage": {"0": 1.5}}}


def test_formulas_at_two_ranks_and_eight_microbatches() -> None:
    assert bench._formula("1f1b", 2, 8, 2)[0] == pytest.approx(1 / 9)
    assert bench._formula("interleaved-1f1b", 2, 8, 2)[0] == pytest.approx(1 / 17)
    assert bench._formula("zb-h1", 2, 8, 2)[0] == pytest.approx(1 / 25)
    assert bench._formula("zbv", 2, 8, 2)[0] == pytest.approx(1 / 49)
    ratios = [bench._peak_formula_vs_1f1b(n, 2, 8, 2) for n in bench.NEW_SCHEDULES]
    assert ratios == [1.25, 1.0, 1.0]
