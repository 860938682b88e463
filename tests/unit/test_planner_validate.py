"""`planner.validate`'s pure parts: the command it runs and the figures it reports."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from polytrain.planner.types import Layout
from polytrain.planner.validate import Trial, TrialSpec, spearman, summarize, toml_value


def test_toml_values_parse_back_as_the_cli_reads_them() -> None:
    from polytrain.config.io import parse_override

    for value in (True, 3, 0.5, "1f1b", [2, 3]):
        assert parse_override(f"a.b={toml_value(value)}")[1] == value


def test_spearman() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert math.isnan(spearman([1], [1]))


def _trial(pred: float, meas: float, states: tuple[float, float] = (math.nan, 1.0)) -> Trial:
    spec = TrialSpec(Layout(), pred, predicted_state_bytes=states[0])
    return Trial(spec, meas, 1.0, states[1], [], Path("."), 1.0)


def test_summary_figures() -> None:
    trials = [_trial(1.0, 1.1, (100, 100)), _trial(2.0, 1.8, (98, 100)), _trial(3.0, 3.3)]
    trials.append(Trial(TrialSpec(Layout(), 0.1), math.nan, 0, 0, [], Path("."), 1, "boom"))
    out = summarize(trials)
    assert out["trials"] == 3  # the failed run is left out
    assert out["median_abs_pct_error"] == pytest.approx(100 / 11, rel=1e-6)
    assert out["spearman"] == pytest.approx(1.0)
    assert out["first_vs_fastest_pct"] == pytest.approx(0.0)
    assert out["max_state_pct_error"] == pytest.approx(2.0)
