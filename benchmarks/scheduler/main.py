"""Scheduling policies on the Philly trace: average and p99 JCT and makespan against FIFO (issue 40).

Question: on a reproducible sample of a real cluster's jobs, how much lower is the job
completion time under each policy than under first-in-first-out, and do the issue's targets
hold (Tiresias >= 2x lower average JCT than FIFO; goodput >= 1.3x lower than Tiresias)?

The sample rule was fixed before any policy was run: 5,000 jobs drawn at random from the whole
trace with seed 0 (``trace.sample``: submission times kept, so the sample keeps the trace's
arrival pattern at ~1/16 of its rate), on two cluster sizes given by the offered load (device-
seconds asked / capacity over the arrival span) of seed 0's sample: 64 devices (load ~0.49) and
32 devices (load ~0.97). Seeds 1 and 2 draw two more samples of the same size, run the same
way, so that no figure holds for one draw only. Jobs asking more devices than the cluster has
are left out and counted. Slice 40 min, restart cost 30 s, the policies' documented defaults.
Every policy runs in the same process on the same jobs; each figure is a ratio against FIFO
run alongside. FIFO with backfill runs too: it shows how much of FIFO's figure is head-of-line
blocking.

[Note: the capped bound] A policy that runs every job on at most the devices it asked for
cannot finish a job sooner than the trace's duration (its speed-up curve rises with the device
count), so the sample's mean duration bounds every such policy's average JCT from below, and
Tiresias's average JCT over that mean is the most any of them can gain on Tiresias. Only a
policy that grows jobs past their ask (``goodput (elastic)``) can go beyond it.

Run: python benchmarks/scheduler/main.py [--trace philly.csv] [--force]
Writes results.json and, for seed 0, cdf_<devices>.png beside this file (``--force`` replaces
the PNGs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TRACE = Path("/work/shared/data/traces/philly.csv")
SAMPLE, SEEDS, DEVICES = 5000, (0, 1, 2), (64, 32)
SLICE_S, RESTART_S = 2400.0, 30.0
ELASTIC = 4.0  # "goodput (elastic)": jobs may grow to 4x their ask, as Pollux sizes them
# "planner curves": each class's speed-up from the planner (scheduler/speedup.py
# planned_curves) instead of the analytic Amdahl classes; only goodput reads the curves


def on_path() -> None:
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)


def run(trace: Path, devices: int, seed: int, force: bool) -> dict[str, Any]:
    from polytrain.scheduler.policies import POLICIES, get_policy
    from polytrain.scheduler.policy import Cluster
    from polytrain.scheduler.report import plot_cdf
    from polytrain.scheduler.simulate import simulate
    from polytrain.scheduler.speedup import PLAN_CLUSTER, planned_curves
    from polytrain.scheduler.trace import fit_cluster, offered_load, read_trace, sample

    jobs, dropped = fit_cluster(sample(read_trace(trace), SAMPLE, seed), devices, drop=True)
    cluster = Cluster(devices, SLICE_S)
    planned = planned_curves(PLAN_CLUSTER, devices)
    # name -> (policy, elastic factor, speed-up curves: None = the analytic classes)
    variants: dict[str, tuple[Any, float, Any]] = {
        name: (get_policy(name), 1.0, None) for name in POLICIES
    }
    variants["fifo+backfill"] = (get_policy("fifo", backfill=True), 1.0, None)  # no blocking
    variants["goodput (elastic)"] = (get_policy("goodput"), ELASTIC, None)
    variants["goodput, planner curves"] = (get_policy("goodput"), 1.0, planned)
    variants["goodput (elastic), planner curves"] = (get_policy("goodput"), ELASTIC, planned)
    summaries, jcts = {}, {}
    for name, (policy, elastic, curves) in variants.items():
        result = simulate(
            jobs, policy, cluster, restart_s=RESTART_S, elastic=elastic, curves=curves
        )
        summaries[name] = result.summary.as_dict() | {"policy": name}
        jcts[name] = [r.jct for r in result.jobs]
        s = result.summary
        print(
            f"seed {seed} {devices:>3} devices {name:<33} avg JCT {s.avg_jct_s / 3600:8.2f} h  p99 "
            f"{s.p99_jct_s / 3600:8.1f} h  makespan {s.makespan_s / 86400:6.1f} d  util "
            f"{s.utilisation:.2f}  preemptions {s.preemptions:>6}  {s.wall_s:5.1f} s",
            flush=True,
        )
    png = HERE / f"cdf_{devices}.png"
    if seed == SEEDS[0]:
        if force:
            png.unlink(missing_ok=True)
        title = f"Philly, {len(jobs)} random jobs (seed {seed}), {devices} devices, slice 40 min"
        plot_cdf(jcts, png, title)
    fifo = summaries["fifo"]
    bound_s = sum(job.duration for job in jobs) / len(jobs)  # [Note: the capped bound]
    ratios = {
        name: {key: fifo[key] / s[key] for key in ("avg_jct_s", "p99_jct_s", "makespan_s")}
        for name, s in summaries.items()
    }
    tiresias, goodput = summaries["tiresias"], summaries["goodput"]
    return {
        "seed": seed,
        "devices": devices,
        "jobs": len(jobs),
        "dropped_oversized": dropped,
        "offered_load": offered_load(jobs, devices),
        "policies": summaries,
        "fifo_over_policy": ratios,
        "capped_bound_avg_jct_s": bound_s,
        "targets": {
            "tiresias_vs_fifo_avg_jct": fifo["avg_jct_s"] / tiresias["avg_jct_s"],
            "goodput_vs_tiresias_avg_jct": tiresias["avg_jct_s"] / goodput["avg_jct_s"],
            "capped_bound_vs_tiresias_avg_jct": tiresias["avg_jct_s"] / bound_s,
            "elastic_goodput_vs_tiresias_avg_jct": tiresias["avg_jct_s"]
            / summaries["goodput (elastic)"]["avg_jct_s"],
            "planner_goodput_vs_tiresias_avg_jct": tiresias["avg_jct_s"]
            / summaries["goodput, planner curves"]["avg_jct_s"],
            "planner_elastic_goodput_vs_tiresias_avg_jct": tiresias["avg_jct_s"]
            / summaries["goodput (elastic), planner curves"]["avg_jct_s"],
        },
        "cdf": png.name if seed == SEEDS[0] else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--force", action="store_true", help="replace existing cdf_*.png")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        print(f"no trace at {args.trace}: pass --trace philly.csv (see README.md)")
        return 2
    on_path()
    started = time.perf_counter()
    configs = [run(args.trace, d, seed, args.force) for seed in SEEDS for d in DEVICES]
    out = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "sample": SAMPLE,
        "seeds": list(SEEDS),
        "slice_s": SLICE_S,
        "restart_s": RESTART_S,
        "configs": configs,
        "wall_s": time.perf_counter() - started,
    }
    (HERE / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    for config in configs:
        t = config["targets"]
        print(
            f"seed {config['seed']} {config['devices']} devices (load "
            f"{config['offered_load']:.2f}): Tiresias / FIFO avg JCT "
            f"{t['tiresias_vs_fifo_avg_jct']:.2f}x lower (target 2), goodput / Tiresias "
            f"{t['goodput_vs_tiresias_avg_jct']:.2f}x lower (target 1.3; no capped policy beyond "
            f"{t['capped_bound_vs_tiresias_avg_jct']:.2f}x), elastic goodput / Tiresias "
            f"{t['elastic_goodput_vs_tiresias_avg_jct']:.2f}x lower; planner curves: goodput "
            f"{t['planner_goodput_vs_tiresias_avg_jct']:.2f}x, elastic "
            f"{t['planner_elastic_goodput_vs_tiresias_avg_jct']:.2f}x"
        )
    print(f"all simulations: {out['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
