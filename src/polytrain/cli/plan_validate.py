"""``polytrain plan --validate K``: run the top K plans here and print predicted against measured.

The plan command calls `validate_plans` with its job and ranked predictions; the runs are real
``polytrain train`` jobs (`planner.validate.run_trials`) of a few steps each.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from polytrain.config.base import to_dict
from polytrain.config.job import JobConfig
from polytrain.errors import PlanError
from polytrain.planner.types import Prediction
from polytrain.planner.validate import Trial, TrialSpec, run_trials, summarize

__all__ = ["job_fields", "trial_specs", "validate_plans"]

# The sections a plan does not choose: the validation runs keep them as the user wrote them.
_WORK_SECTIONS = ("model", "data", "optim", "train")


def job_fields(job: JobConfig) -> dict[str, Any]:
    """``job``'s model, data, optimizer and training fields as dotted keys (``model.name``)."""
    data = to_dict(job)
    return {
        f"{section}.{key}": value
        for section in _WORK_SECTIONS
        for key, value in data.get(section, {}).items()
        if value is not None
    }


def trial_specs(predictions: Sequence[Prediction], process: float = 0.0) -> list[TrialSpec]:
    """One spec per prediction. A pipeline runs the partition the cost model priced: `predict`
    sets it on the layout and `Layout.overrides` writes ``pipeline.partition``. ``process``: what
    a worker holds besides the cost model's memory per rank ([Note: a worker's own memory] in
    planner/memory.py), added to the predicted peak that is compared with its resident peak."""
    specs = []
    for pred in predictions:
        specs.append(
            TrialSpec(
                pred.layout,
                pred.step_s,
                predicted_peak_bytes=pred.memory_per_rank + process,
            )
        )
    return specs


def _name(pred: Prediction) -> str:
    describe = getattr(pred.layout, "describe", None)
    if callable(describe):
        return str(describe())
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in pred.layout.overrides().items())


def validate_plans(
    job: JobConfig,
    predictions: Sequence[Prediction],
    k: int,
    *,
    steps: int = 8,
    console: Console | None = None,
    workdir: Path | None = None,
    process: float = 0.0,
) -> list[Trial]:
    """Run the first ``k`` predictions for ``steps`` steps each and print a comparison table
    (``process``: see `trial_specs`)."""
    if k < 1:
        raise PlanError(f"--validate {k}: expected the number of plans to run, at least 1")
    console = console or Console()
    chosen = list(predictions[:k])
    root = workdir or Path(tempfile.mkdtemp(prefix="polytrain-validate-"))
    console.print(f"validating {len(chosen)} plan(s) here, {steps} steps each (runs in {root})")

    def show(trial: Trial) -> None:
        what = trial.error or f"{trial.measured_step_s * 1e3:.1f} ms/step"
        console.print(f"  ran {trial.spec.label}: {what} ({trial.wall_s:.0f} s)")

    specs = [
        replace(s, label=_name(p))
        for s, p in zip(trial_specs(chosen, process), chosen, strict=True)
    ]
    trials = run_trials(specs, job_fields(job), root, steps=steps, on_trial=show)
    table = Table(title="predicted against measured (this host)")
    for col in (
        "#",
        "layout",
        "predicted",
        "measured",
        "error",
        "peak memory measured (predicted)",
    ):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for i, t in enumerate(trials, 1):
        if not t.ok:
            table.add_row(str(i), t.spec.label, "-", "failed", t.error, "-")
            continue
        err = 100 * (t.spec.predicted_step_s - t.measured_step_s) / t.measured_step_s
        peak = "-"
        if math.isfinite(t.peak_bytes):
            peak = f"{t.peak_bytes / 2**20:.0f} MiB ({t.spec.predicted_peak_bytes / 2**20:.0f})"
        table.add_row(
            str(i),
            t.spec.label,
            f"{t.spec.predicted_step_s * 1e3:.1f} ms",
            f"{t.measured_step_s * 1e3:.1f} ms",
            f"{err:+.0f}%",
            peak,
        )
    console.print(table)
    summary = summarize(trials)
    if summary.get("trials", 0) >= 2:
        console.print(
            f"median |error| {summary['median_abs_pct_error']:.0f}%, Spearman "
            f"{summary['spearman']:.2f}, first plan {summary['first_vs_fastest_pct']:+.0f}% "
            "against the fastest measured"
        )
    return trials
