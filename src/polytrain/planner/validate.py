"""Hold predictions against measurement: run each layout here for a few steps and compare.

`polytrain plan --validate K` and `benchmarks/planner` both call `run_trials`. Each trial is a
real ``polytrain train`` run in a subprocess (the same launcher, workers and strategies a user
gets), with the layout's `JobConfig` fields; the trainer writes ``rank-<r>.json`` per rank
(step times, peak memory, the bytes of parameters, gradients and optimizer state it holds),
which this module reads. Pure Python: it starts processes and reads JSON, it imports no torch.

[Note: measured step time] The first steps of a run pay for allocation, connection set-up and
(for ``pipeline.partition = "auto"``) trials, so a trial drops ``warmup`` steps and reports the
mean of the rest on rank 0, the rank whose times `metrics.jsonl` shows. The mean, not the
median: the planner predicts the time to finish (steps x step time), and a run pays its slow
steps too; on the 2-core VM a latency-bound model's steps are bimodal (the mlp's pp2 PipeDream
steps of one run: 4.7-13.0 ms), and the median of a few steps picks a mode by chance (until
2026-11-25 evening it was the median).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polytrain.planner.types import Layout

__all__ = [
    "Trial",
    "TrialSpec",
    "held_state_bytes",
    "run_trials",
    "spearman",
    "summarize",
    "toml_value",
]


@dataclass(frozen=True)
class TrialSpec:
    """One layout to run, with what the planner predicted for it."""

    layout: Layout
    predicted_step_s: float
    predicted_peak_bytes: float = math.nan  # busiest rank, whole process
    predicted_state_bytes: float = math.nan  # params + grads + optimizer state, busiest rank
    extra: dict[str, Any] = field(default_factory=dict)  # more JobConfig fields (partition ...)
    label: str = ""


@dataclass(frozen=True)
class Trial:
    spec: TrialSpec
    measured_step_s: float  # NaN when the run failed
    peak_bytes: float  # max over ranks of the resident high-water mark (CUDA: allocator peak)
    state_bytes: float  # max over ranks of params + grads + optimizer state held
    ranks: list[dict[str, Any]]
    run_dir: Path
    wall_s: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def toml_value(value: Any) -> str:
    """``value`` as the right-hand side of ``--set key=value`` (parsed as TOML by the CLI)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table (model.args)
        return (
            "{"
            + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items())
            + "}"
        )
    return json.dumps(str(value))  # a basic TOML string


def _command(
    spec: TrialSpec, base: dict[str, Any], steps: int, run_dir: Path, python: str
) -> list[str]:
    fields: dict[str, Any] = {
        **base,
        **spec.layout.overrides(),
        **spec.extra,
        "strategy": "manual",
        "train.steps": steps,
        "train.eval_every": 0,
        "train.eval_batches": 1,
        "train.sample_tokens": 0,
        "observe.out_dir": str(run_dir),
        # the last step only: the rank summaries hold every step's time anyway, and a logged
        # step does extra work the planner does not price (a metrics line; gossip's consensus
        # distance, a full-model all-reduce)
        "observe.log_every": steps,
        "observe.progress": False,
    }
    cmd = [python, "-m", "polytrain.cli.app", "train"]
    for key, value in fields.items():
        cmd += ["--set", f"{key}={toml_value(value)}"]
    return cmd


def held_state_bytes(rank: dict[str, Any]) -> float:
    """Model-state bytes one rank held: the larger of its reading just before the last update
    (gradients all held; [Note: model states at the update] in observe/metrics.py) and after
    the run (a rank without an optimizer has only the latter)."""
    after = float(sum(rank["state_bytes"].values()))
    at_update = float(sum((rank.get("state_bytes_at_update") or {}).values()))
    return max(after, at_update)


def _read_ranks(run_dir: Path) -> list[dict[str, Any]]:
    files = sorted(run_dir.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return [json.loads(p.read_text()) for p in files]


def _measured_step(rank0: dict[str, Any], warmup: int) -> float:
    times = rank0.get("step_times_s") or []
    kept = times[warmup:] if len(times) > warmup else times
    return statistics.mean(kept) if kept else math.nan


def run_trials(
    specs: Sequence[TrialSpec],
    base: dict[str, Any],
    workdir: Path,
    *,
    steps: int = 8,
    warmup: int = 3,
    timeout_s: float = 600.0,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> list[Trial]:
    """Run every spec for ``steps`` steps with the job fields ``base`` (dotted keys, e.g.
    ``{"model.name": "mlp"}``) under ``workdir``; a failed run is a `Trial` with its error."""
    workdir.mkdir(parents=True, exist_ok=True)
    out: list[Trial] = []
    for index, spec in enumerate(specs):
        run_dir = workdir / f"trial-{index:02d}-{time.time_ns()}"
        cmd = _command(spec, base, steps, run_dir, python)
        t0 = time.perf_counter()
        error = ""
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={**os.environ, **(env or {})},
            )
            if proc.returncode != 0:
                lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
                error = lines[-1] if lines else f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            error = f"did not finish within {timeout_s:.0f} s"
        wall = time.perf_counter() - t0
        ranks = _read_ranks(run_dir) if run_dir.exists() else []
        if not error and not ranks:
            error = "the run wrote no rank-<r>.json summaries"
        trial = Trial(
            spec=spec,
            measured_step_s=_measured_step(ranks[0], warmup) if ranks else math.nan,
            peak_bytes=max((r["peak_memory_mb"] * 2**20 for r in ranks), default=math.nan),
            state_bytes=max((held_state_bytes(r) for r in ranks), default=math.nan),
            ranks=ranks,
            run_dir=run_dir,
            wall_s=wall,
            error=error,
        )
        out.append(trial)
        if on_trial is not None:
            on_trial(trial)
    return out


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's r of the ranks, ties averaged)."""
    ra, rb = _ranks(a), _ranks(b)
    n = len(ra)
    if n < 2:
        return math.nan
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else math.nan


def summarize(trials: Sequence[Trial]) -> dict[str, float]:
    """The validation figures over the trials that ran: median absolute % error of step time,
    Spearman rank correlation, and how far the predicted-best layout is from the measured-best."""
    ok = [t for t in trials if t.ok and math.isfinite(t.measured_step_s)]
    if not ok:
        return {"trials": 0.0}
    pred = [t.spec.predicted_step_s for t in ok]
    meas = [t.measured_step_s for t in ok]
    errors = [abs(p - m) / m for p, m in zip(pred, meas, strict=True)]
    first = min(range(len(ok)), key=lambda i: pred[i])
    fastest = min(meas)
    out = {
        "trials": float(len(ok)),
        "median_abs_pct_error": 100 * statistics.median(errors),
        "spearman": spearman(pred, meas),
        "first_vs_fastest_pct": 100 * (meas[first] / fastest - 1),
    }
    states = [
        abs(t.spec.predicted_state_bytes - t.state_bytes) / t.state_bytes
        for t in ok
        if math.isfinite(t.spec.predicted_state_bytes) and t.state_bytes > 0
    ]
    if states:
        out["median_state_pct_error"] = 100 * statistics.median(states)
        out["max_state_pct_error"] = 100 * max(states)
    peaks = [
        abs(t.spec.predicted_peak_bytes - t.peak_bytes) / t.peak_bytes
        for t in ok
        if math.isfinite(t.spec.predicted_peak_bytes) and t.peak_bytes > 0
    ]
    if peaks:
        out["median_peak_pct_error"] = 100 * statistics.median(peaks)
        out["max_peak_pct_error"] = 100 * max(peaks)
    return out
