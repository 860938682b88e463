"""How far the planner's predictions move from one calibration of this host to the next.

Runs one calibration of the full plan (`measure.calibrate.calibrate`, ``repeats=1``) ``--runs``
times in a row, saves each profile under ``--workdir``, and prices the benchmark's 14 layouts of
gpt tiny and mlp tiny on each (`main.predict_all`, no training runs). Prints, per layout, the
predicted step time of every calibration and their spread (max over min, less one), the same for
the profile's per-call figures that price the latency-bound layouts, and how far two
calibrations' predictions lie apart: single ones, medians of ``--median-of`` consecutive ones
(what `polytrain calibrate` keeps: [Note: repeated calibrations] in planner/profile_io.py), and
those medians rescaled to each other's speed figures ([Note: host drift]). A prediction that
moves 30% between two calibrations a few minutes apart cannot be within 10% of a measurement
except by chance: this is the floor under `main.py`'s errors on a host whose speed drifts.

    python benchmarks/planner/repeat.py --runs 6 --workdir /tmp/repeat   # ~12 min here
    python benchmarks/planner/repeat.py --reuse /tmp/repeat   # price saved profiles again

Results and what they showed: docs/planner.md "Calibration" ("Repeated calibrations").
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from main import MODELS, layouts, predict_all  # this folder's benchmark (the script's path)

from polytrain.config.io import job_from_fields
from polytrain.measure.calibrate import CalibrationPlan, calibrate
from polytrain.measure.stats import model_stats
from polytrain.planner.drift import rescaled, speed_ratios
from polytrain.planner.profile_io import load_profile, median_profile, save_profile
from polytrain.planner.types import HostProfile

# (label, how to read it from a profile): the per-call figures of the latency-bound layouts
FIGURES: dict[str, Any] = {
    "operator call us": lambda p: p.op_s * 1e6,
    "loop per step us": lambda p: p.loop_step_s * 1e6,
    "adamw per tensor us": lambda p: p.step_costs.get("adamw", (0.0, 0.0))[0] * 1e6,
    "all-reduce 16 B, 2 ranks ms": lambda p: _ar(p, 2) * 1e3,
    "all-reduce 16 B, 4 ranks ms": lambda p: _ar(p, 4) * 1e3,
    "reduce in a step, 2 ranks ms": lambda p: p.reduce_in_step.get(2, 0.0) * 1e3,
    "reduce in a step, 4 ranks ms": lambda p: p.reduce_in_step.get(4, 0.0) * 1e3,
    "step slowdown, 2 at once": lambda p: p.step_slowdown.get(2, 0.0),
    "step slowdown, 4 at once": lambda p: p.step_slowdown.get(4, 0.0),
    "pipeline 1f1b per action us": lambda p: p.pipe_action_s.get("1f1b", 0.0) * 1e6,
    "pipeline gpipe per action us": lambda p: p.pipe_action_s.get("gpipe", 0.0) * 1e6,
    "matmul fp32 GFLOP/s": lambda p: p.matmul_flops.get("fp32", 0.0) / 1e9,
    "host speed moved %": lambda p: p.spread.get("host speed during calibration", 0.0) * 100,
}


def _ar(profile: HostProfile, world: int) -> float:
    curve = profile.collectives.get("all_reduce", {}).get(world)
    return min(curve.points)[1] if curve is not None else 0.0


def _spread(values: list[float]) -> float:
    """max / min - 1 over ``values`` (0 when any is not positive)."""
    return max(values) / min(values) - 1.0 if min(values) > 0 else 0.0


def _pairs(priced: list[list[float]]) -> list[float]:
    """|a / b - 1| of every layout over every pair of calibrations' predictions."""
    out = []
    for a, b in itertools.combinations(priced, 2):
        out += [abs(x / y - 1.0) for x, y in zip(a, b, strict=True) if y > 0]
    return out


def _describe(label: str, values: list[float]) -> str:
    if not values:
        return f"{label}: none"
    tenth = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]
    return (
        f"{label}: median {100 * statistics.median(values):.1f}%, 90th percentile "
        f"{100 * tenth:.1f}%, max {100 * max(values):.1f}%"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="calibrations in a row")
    ap.add_argument("--workdir", default="repeat", help="where the profiles are saved")
    ap.add_argument("--reuse", default="", help="a --workdir of saved profiles: price them only")
    ap.add_argument(
        "--median-of",
        type=int,
        default=3,
        help="also compare medians of this many consecutive calibrations (what `polytrain "
        "calibrate` keeps), and each such median rescaled to the others' speed figures",
    )
    args = ap.parse_args()
    profiles: list[HostProfile] = []
    if args.reuse:
        profiles = [load_profile(p) for p in sorted(Path(args.reuse).glob("profile-*.json"))]
    else:
        work = Path(args.workdir)
        work.mkdir(parents=True, exist_ok=True)
        for run in range(args.runs):
            t0 = time.perf_counter()
            profile = calibrate(replace(CalibrationPlan(), repeats=1))
            save_profile(profile, work / f"profile-{run}.json", {"run": str(run)})
            profiles.append(profile)
            print(f"calibration {run}: {time.perf_counter() - t0:.0f} s", flush=True)
    if len(profiles) < 2:
        raise SystemExit("repeat.py: needs two profiles or more (--runs, --reuse)")
    width = 8 * len(profiles)
    print(f"\n{'figure':32s} {'each calibration':>{width}s}  spread")
    for label, read in FIGURES.items():
        values = [float(read(p)) for p in profiles]
        cells = "".join(f"{v:8.2f}" for v in values)
        print(f"{label:32s} {cells}  {100 * _spread(values):5.0f}%")
    summary: dict[str, Any] = {}
    for model, fields in MODELS.items():
        job = job_from_fields(fields)
        stats = model_stats(job, device="cpu")
        items = layouts()
        priced = [predict_all(stats, p, job, items) for p in profiles]
        print(f"\n{model}: predicted step time (ms) per calibration")
        spreads = []
        for i, layout in enumerate(items):
            values = [run[i]["step_s"] * 1e3 for run in priced]
            spreads.append(_spread(values))
            cells = "".join(f"{v:8.2f}" for v in values)
            print(f"{layout.describe():32s} {cells}  {100 * spreads[-1]:5.0f}%")
        median = statistics.median(spreads)
        print(f"{model}: median spread of the predictions {100 * median:.0f}%")
        summary[model] = {"median_spread_pct": 100 * median, "max_spread_pct": 100 * max(spreads)}
        single = [[x["step_s"] for x in run] for run in priced]
        print(_describe(f"{model}, pairs of single calibrations", _pairs(single)))
        k = args.median_of
        groups = [profiles[i : i + k] for i in range(0, len(profiles) - k + 1, k)]
        if k > 1 and len(groups) > 1:
            medians = [median_profile(g) for g in groups]
            price = [[x["step_s"] for x in predict_all(stats, m, job, items)] for m in medians]
            print(_describe(f"{model}, pairs of medians of {k}", _pairs(price)))
            moved = []  # each median at another's speed figures ([Note: host drift])
            for a, b in itertools.permutations(range(len(medians)), 2):
                at_b = rescaled(medians[a], speed_ratios(medians[a].speed, medians[b].speed))
                there = [x["step_s"] for x in predict_all(stats, at_b, job, items)]
                moved += _pairs([there, price[b]])
            print(_describe(f"{model}, medians of {k} rescaled to each other's speed", moved))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
