"""Planner benchmark: predicted against measured step time and memory on this host.

Runs at least 12 layouts of the default job (gpt tiny) and of mlp tiny through the real trainer
(`planner.validate.run_trials`), predicts each with the planner's cost model from this host's
calibrated profile, and reports the median absolute % error of step time, Spearman's rank
correlation, whether the layout the planner ranks first is within 10% of the fastest measured,
model-state bytes per rank against the bytes actually held, and peak memory against the
measured high-water mark; beside ours, Accelerate's ``estimate-memory`` and DeepSpeed's
``estimate_zero2/3_model_states_mem_needs`` on the same models. See README.md.

    python benchmarks/planner/main.py                       # calibrate if needed, run, report
    python benchmarks/planner/main.py --reuse results.json  # predictions again, same measurements
    python benchmarks/planner/main.py --models gpt --layouts dp1,dp2,tp2   # a subset
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

from polytrain.config.io import job_from_fields
from polytrain.config.job import JobConfig
from polytrain.measure.calibrate import CalibrationPlan, cached_profile
from polytrain.measure.host import speed_sample
from polytrain.measure.stats import model_stats
from polytrain.planner.drift import SPEED_FIGURES, describe, drifted, rescaled, speed_ratios
from polytrain.planner.types import HostProfile, Layout, ModelStats
from polytrain.planner.validate import Trial, TrialSpec, held_state_bytes, run_trials, spearman

HERE = Path(__file__).resolve().parent

MODELS: dict[str, dict[str, Any]] = {
    "gpt": {},
    "mlp": {"model.name": "mlp"},
    # a user's own model (opt-in: --models gpt2): transformers' GPT-2, 4 layers of width 128
    "gpt2": {"model.name": "benchmarks.planner.users_models:gpt2"},
}
DEFAULT_MODELS = ["gpt", "mlp"]
STEPS = {
    "gpt": 10,
    "mlp": 60,
    "gpt2": 10,
}  # per run, the first --warmup dropped; the mean of the rest


def layouts() -> list[Layout]:
    """The layouts run for each model by default: every synchronous strategy family and the
    asynchronous ones the issue names, world sizes 1 to 4."""
    return [
        Layout(dp=1),
        Layout(dp=2),
        Layout(dp=4),
        Layout(dp=2, zero=2),
        Layout(dp=2, zero=3),
        Layout(tp=2),
        Layout(pp=2, schedule="gpipe", microbatches=4),
        Layout(pp=2, schedule="1f1b", microbatches=4),
        Layout(pp=2, schedule="pipedream", microbatches=4),
        Layout(pp=4, schedule="1f1b", microbatches=8),
        Layout(dp=2, sync="ps", ps_servers=1, ps_mode="sync"),
        Layout(dp=2, sync="ps", ps_servers=1, ps_mode="async"),
        Layout(dp=2, tp=2),
        Layout(dp=2, pp=2, schedule="1f1b", microbatches=4),
    ]


def extra_layouts() -> list[Layout]:
    """Layouts ``--layouts`` can name beyond the default set (decentralized replicas)."""
    return [
        Layout(dp=4, sync="gossip", topology="ring"),
        Layout(dp=4, sync="gossip", topology="complete"),
        Layout(dp=4, sync="localsgd", period=4),
    ]


def select_layouts(spec: str) -> list[Layout]:
    """``--layouts``: comma-separated `Layout.describe` names, ``default`` for the default set;
    an unknown name is one line listing the known ones."""
    known = {lay.describe(): lay for lay in layouts() + extra_layouts()}
    out: list[Layout] = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        if name == "default":
            out += [lay for lay in layouts() if lay not in out]
        elif name in known:
            if known[name] not in out:
                out.append(known[name])
        else:
            raise SystemExit(
                f"--layouts: unknown layout {name!r}; known: default, {', '.join(known)}"
            )
    if not out:
        raise SystemExit("--layouts: name at least one layout (or 'default')")
    return out


def select_models(spec: str) -> list[str]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in MODELS]
    if bad or not names:
        raise SystemExit(f"--models: unknown {bad or spec!r}; known: {', '.join(MODELS)}")
    return names


def _trial_name(trial: dict[str, Any]) -> str:
    """The layout name of a stored trial (results written before newer `Layout` fields load
    with those fields' defaults)."""
    fields = dict(trial["layout"])
    if isinstance(fields.get("partition"), list):
        fields["partition"] = tuple(fields["partition"])
    return Layout(**fields).describe()


def _name(layout: Layout) -> str:
    describe = getattr(layout, "describe", None)  # planner's Layout.describe when merged
    if callable(describe):
        return str(describe())
    return ",".join(f"{k.split('.')[-1]}={v}" for k, v in layout.overrides().items())


# -- the planner's cost model (pure) ---------------------------------------------------------
def _planner() -> Any:
    """The cost-model modules (planner's branch); imported here so a missing one is one line."""
    import importlib

    names = ("cost", "cluster", "partition", "memory")
    return {n: importlib.import_module(f"polytrain.planner.{n}") for n in names}


def predict_all(
    stats: ModelStats, profile: HostProfile, job: JobConfig, items: list[Layout]
) -> list[dict[str, Any]]:
    """Predicted step time, peak and model-state bytes of each layout (busiest rank)."""
    p = _planner()
    host = p["cluster"].parse_cluster("1x4xcpu")
    out = []
    for layout in items:
        # the ranks the trial starts, all computing at once ([Note: shared cores])
        cluster = host.with_size(layout.devices)
        env = p["cost"].Env(cluster, job.train.dtype, profile, job.parallel.bucket_mb * 2**20)
        pred = p["cost"].predict(layout, stats, env, job.train.global_batch_size)
        # a user's model pipelines over its layers ([Note: layer view] in measure/layer_stats.py)
        units = stats.pipeline_blocks if layout.pp > 1 else stats.blocks
        stages = p["partition"].balanced_stages(units, layout.pp)
        micro = (layout.microbatches if layout.pp > 1 else 1) * layout.grad_accum
        mb = job.train.global_batch_size / layout.dp / micro
        # Model states exclude PipeDream's stashed weight versions on both sides (the runtime's
        # stash is not a parameter, so `model_state_bytes` does not see it).
        plain = replace(layout, schedule="1f1b") if layout.schedule == "pipedream" else layout
        states = max(
            p["memory"].memory_per_rank(stats, plain, [stage], mb).model_states for stage in stages
        )
        counts = [len(s) for s in stages]
        out.append(
            {
                "step_s": pred.step_s,
                "memory_per_rank": pred.memory_per_rank,
                "states": states,
                "server_states": (
                    p["memory"].ps_server_memory(stats, layout).model_states
                    if layout.sync == "ps"
                    else None
                ),
                "breakdown": pred.breakdown,
                "partition": counts if layout.pp > 1 else None,
            }
        )
    return out


# -- the host's speed against its profile ---------------------------------------------------
def mean_ratios(profile: HostProfile, samples: list[dict[str, float]]) -> dict[str, float]:
    """Per speed figure, the mean over ``samples`` (`measure.host.speed_sample` results) of how
    fast the host ran against ``profile`` ([Note: host drift] in planner/drift.py); {} for a
    profile without speed figures."""
    per = [speed_ratios(profile.speed, s) for s in samples]
    names = [n for n in SPEED_FIGURES if per and all(n in r for r in per)]
    return {n: statistics.mean(r[n] for r in per) for n in names}


def predict_at_speed(
    stats: ModelStats,
    profile: HostProfile,
    job: JobConfig,
    items: list[Layout],
    speed: dict[str, float],
) -> list[dict[str, Any]]:
    """Each layout predicted on ``profile`` rescaled to ``speed``, the host's speed over the
    model's runs ([Note: rescaled to the runs' speed])."""
    return predict_all(stats, rescaled(profile, speed), job, items)


def sample_speed(profile: HostProfile, samples: list[dict[str, float]]) -> None:
    """Time the speed figures now, append them to ``samples`` and print them against the
    profile's."""
    samples.append(speed_sample(profile.threads))
    now = describe(speed_ratios(profile.speed, samples[-1]))
    print(f"    host speed against the profile: {now}", flush=True)


# [Note: rescaled to the runs' speed] The speed figures are timed before the first run and after
# every run ([Note: rounds of runs]; ~0.5 s each, ~40 s over the 84 runs), and a model's
# predictions ("flops" and "measured") are priced on the profile rescaled to their mean over all
# of that model's samples: the host's speed over its runs, against the speed at which it was
# calibrated; "flops, as calibrated" on the profile as saved, so the table shows what rescaling
# changed. One level, not each run's own: the samples do not track single runs. Multiplying
# each round's step time by the speed ratio read around that run (what pricing each run at its
# own speed assumes: a run on a host sampled 1.2x fast is worth 1.2x its time) left the spread of a layout's three rounds where it was (median
# over layouts 19-21% -> 18-19% with the matmul figures) or nearly doubled it (the operator
# figure: 15-24% -> 38-50%), in both runs that sampled around every run (18:34 and 20:25 on
# 2026-11-26); a ~10 s run meets several of the host's phases, a 0.5 s sample one. Repricing
# those two runs: gpt tiny 7.8% / 8.8% per run -> 11.5% / 6.8% at the mean of all samples,
# mlp tiny 15.8% / 22.8% -> 10.5% / 15.0% (and 14.9% / 15.5% as calibrated). Per-run pricing
# is how 18:34 and 20:25 were first reported; per-round (18:10) had been worse than either.


# -- the peers' estimators -------------------------------------------------------------------
def peer_estimates(stats: ModelStats, layout: Layout) -> dict[str, float | str]:
    """Accelerate's and DeepSpeed's model-state estimates for this layout, or why not."""
    out: dict[str, float | str] = {}
    try:
        from accelerate.commands.estimate import estimate_training_usage

        # estimate-memory's "Training using Adam" column: the largest of its four terms.
        usage = estimate_training_usage(stats.param_bytes, "float32")
        out["accelerate"] = float(max(usage.values()))
    except ImportError as exc:
        out["accelerate"] = f"not installed ({exc})"
    if layout.zero in (2, 3):
        try:
            if layout.zero == 2:
                from deepspeed.runtime.zero.stage_1_and_2 import (
                    estimate_zero2_model_states_mem_needs,
                )

                _, per_device = estimate_zero2_model_states_mem_needs(
                    stats.params, num_gpus_per_node=layout.dp, cpu_offload=False
                )
            else:
                from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

                largest = max(b.params for b in stats.blocks)
                _, per_device, _ = estimate_zero3_model_states_mem_needs(
                    stats.params,
                    largest,
                    num_gpus_per_node=layout.dp,
                    cpu_offload=False,
                    zero_init=False,
                )
            out["deepspeed"] = float(per_device)
        except ImportError as exc:
            out["deepspeed"] = f"not installed ({exc})"
    return out


# -- measurement -----------------------------------------------------------------------------
def _trainer_ranks(layout: Layout) -> int:
    return layout.dp * layout.tp * layout.pp


def measured_figures(trial: dict[str, Any], layout: Layout) -> dict[str, float]:
    """Per-trial measured figures over the trainer ranks (parameter servers reported apart)."""
    ranks = trial["ranks"]
    n = _trainer_ranks(layout)
    workers, servers = ranks[:n], ranks[n:]
    out = {
        "step_s": trial["measured_step_s"],
        "states": max(held_state_bytes(r) for r in workers),
        # every rank: the predicted peak is the busiest rank's, a server's included
        "peak": max(r["peak_memory_mb"] for r in ranks) * 2**20,
    }
    if servers:
        out["server_states"] = max(held_state_bytes(r) for r in servers)
    return out


# [Note: rounds of runs]
# On the 2-core VM the host's speed shifts for seconds at a time: one gpt tiny pp2 GPipe run of
# 2026-11-26 stepped at 91-94 ms, then 197-230 ms from its seventh step on; the same layout
# measured 112, 96 and 179 ms in three runs of the day, and a pass over the 28 layouts moved the
# median error by 10 points between passes. A run lasts a few seconds, so one run per layout
# measures the host's moment as much as the layout. `--rounds R` (default 3) runs every layout
# once per round, R rounds one after another (a layout's runs minutes apart), and keeps the run
# with the median step time (its memory figures too); `round_step_s` in results.json lists all.
def measure(
    model: str,
    items: list[Layout],
    partitions: list[Any],
    args: argparse.Namespace,
    between: Callable[[], None],
) -> list[dict[str, Any]]:
    """Every layout's figures, `--rounds` rounds of runs ([Note: rounds of runs]); ``between``
    runs before the first run and after every run ([Note: rescaled to the runs' speed])."""
    specs = [
        TrialSpec(
            layout,
            predicted_step_s=math.nan,
            extra={"pipeline.partition": part} if part else {},
        )
        for layout, part in zip(items, partitions, strict=True)
    ]

    def show(trial: Trial) -> None:
        status = trial.error or f"{trial.measured_step_s * 1e3:.1f} ms/step"
        print(f"  {model} {_name(trial.spec.layout)}: {status} ({trial.wall_s:.0f} s)", flush=True)
        between()  # [Note: rescaled to the runs' speed]: after every run

    # [Note: rounds of runs] each round runs every layout once; a layout's figures are its
    # median round's (by step time), so its runs sit minutes apart
    between()  # before the first run
    rounds = [
        run_trials(
            specs,
            MODELS[model],
            Path(args.workdir) / model,
            steps=args.steps or STEPS[model],
            warmup=args.warmup,
            on_trial=show,
        )
        for _ in range(args.rounds)
    ]
    out = []
    for runs in zip(*rounds, strict=True):
        ok = sorted(
            (i for i, t in enumerate(runs) if not t.error), key=lambda i: runs[i].measured_step_s
        )
        k = ok[(len(ok) - 1) // 2] if ok else 0
        t = runs[k]
        out.append(
            {
                "layout": asdict(t.spec.layout),
                "extra": t.spec.extra,
                "measured_step_s": t.measured_step_s,
                "round_step_s": [r.measured_step_s for r in runs],
                "round": k,  # the round whose run counts ([Note: rounds of runs])
                "ranks": t.ranks,
                "error": t.error,
                "wall_s": t.wall_s,
            }
        )
    return out


# -- report ----------------------------------------------------------------------------------
def _pct(pred: float, meas: float) -> float:
    return 100 * (pred - meas) / meas


def report(model: str, rows: list[dict[str, Any]], variant: str) -> dict[str, Any]:
    ok = [r for r in rows if not r["error"] and math.isfinite(r["measured"]["step_s"])]
    pred = [r["predicted"][variant]["step_s"] for r in ok]
    meas = [r["measured"]["step_s"] for r in ok]
    errors = [abs(_pct(p, m)) for p, m in zip(pred, meas, strict=True)]
    first = min(range(len(ok)), key=lambda i: pred[i])
    fastest = min(range(len(ok)), key=lambda i: meas[i])
    states = [abs(_pct(r["predicted"][variant]["states"], r["measured"]["states"])) for r in ok]
    peaks = [abs(_pct(r["predicted"][variant]["peak"], r["measured"]["peak"])) for r in ok]
    return {
        "model": model,
        "variant": variant,
        "layouts": len(ok),
        "failed": [r["name"] for r in rows if r["error"]],
        "median_abs_pct_error": statistics.median(errors),
        "spearman": spearman(pred, meas),
        "first": ok[first]["name"],
        "fastest": ok[fastest]["name"],
        "first_vs_fastest_pct": 100 * (meas[first] / meas[fastest] - 1),
        "states_median_abs_pct": statistics.median(states),
        "states_max_abs_pct": max(states),
        "peak_median_abs_pct": statistics.median(peaks),
        "peak_max_abs_pct": max(peaks),
    }


def print_rows(model: str, rows: list[dict[str, Any]], variant: str) -> None:
    print(f"\n{model} ({variant} block times): predicted vs measured")
    head = (
        f"{'layout':44} {'pred ms':>8} {'meas ms':>8} {'err%':>6} | {'states pred':>11} "
        f"{'held':>9} {'err%':>6} | {'peak pred':>9} {'meas':>9} {'err%':>6} | accel  ds"
    )
    print(head)
    mib = 2**20
    for r in rows:
        if r["error"]:
            print(f"{r['name']:44} failed: {r['error']}")
            continue
        p, m, peers = r["predicted"][variant], r["measured"], r["peers"]
        acc = peers.get("accelerate")
        ds = peers.get("deepspeed")
        acc_s = f"{_pct(acc, m['states']):+.0f}%" if isinstance(acc, float) else "-"
        ds_s = f"{_pct(ds, m['states']):+.0f}%" if isinstance(ds, float) else "-"
        print(
            f"{r['name']:44} {p['step_s'] * 1e3:8.1f} {m['step_s'] * 1e3:8.1f} "
            f"{_pct(p['step_s'], m['step_s']):+6.0f} | {p['states'] / mib:9.2f}Mi "
            f"{m['states'] / mib:7.2f}Mi {_pct(p['states'], m['states']):+6.1f} | "
            f"{p['peak'] / mib:7.0f}Mi {m['peak'] / mib:7.0f}Mi {_pct(p['peak'], m['peak']):+6.0f} "
            f"| {acc_s:>6} {ds_s:>4}"
        )
        if p.get("server_states") and m.get("server_states"):
            print(
                f"{'  its parameter server (model states)':44} {'':26} | "
                f"{p['server_states'] / mib:9.2f}Mi {m['server_states'] / mib:7.2f}Mi "
                f"{_pct(p['server_states'], m['server_states']):+6.1f} |"
            )


def markdown_summary(summaries: list[dict[str, Any]]) -> str:
    """The README's results table (same columns), to paste after a run."""
    lines = [
        "| model | variant | median abs. step-time error | Spearman | ranked first / fastest "
        "measured | first vs fastest | model states: median / max error | peak: median / max "
        "error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in summaries:
        lines.append(
            f"| {s['model']} tiny | {s['variant']} | {s['median_abs_pct_error']:.0f}% | "
            f"{s['spearman']:.2f} | {s['first']} / {s['fastest']} | "
            f"{s['first_vs_fastest_pct']:+.0f}% | {s['states_median_abs_pct']:.1f}% / "
            f"{s['states_max_abs_pct']:.1f}% | {s['peak_median_abs_pct']:.0f}% / "
            f"{s['peak_max_abs_pct']:.0f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help="comma-separated: gpt, mlp, gpt2 (transformers' GPT-2, a user's model)",
    )
    ap.add_argument(
        "--layouts",
        default="default",
        help="comma-separated layout names (dp2, pp2-1f1b-m4, gossip-ring-w4, ...); "
        "'default' = the 14 of README.md",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=0,
        help="steps per run (0: gpt 10, mlp 60: the mlp's ms-scale steps are bimodal on a "
        "shared host, so it takes more of them for the same run time)",
    )
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs of each layout, one per round over all of them; the median round's figures "
        "count (this host's speed shifts for seconds at a time)",
    )
    ap.add_argument("--workdir", default="/tmp/polytrain-planner-bench")
    ap.add_argument(
        "--out", default="", help="default: results.json here for the full set, else in --workdir"
    )
    ap.add_argument("--reuse", default="", help="results.json whose measurements to reuse")
    ap.add_argument("--cache-dir", default="", help="profile cache (default $POLYTRAIN_CACHE)")
    ap.add_argument("--recalibrate", action="store_true")
    ap.add_argument("--quick-calibration", action="store_true")
    args = ap.parse_args()
    items = select_layouts(args.layouts)
    models = select_models(args.models)
    full = items == layouts() and models == DEFAULT_MODELS
    out_path = (
        Path(args.out) if args.out else (HERE if full else Path(args.workdir)) / "results.json"
    )

    plan = CalibrationPlan.quick() if args.quick_calibration else CalibrationPlan()
    profile, path, fresh = cached_profile(
        plan,
        force=args.recalibrate,
        directory=Path(args.cache_dir) if args.cache_dir else None,
        on_progress=lambda what: print(f"  calibrate: {what}", flush=True),
    )
    print(f"profile {path} ({'measured now' if fresh else 'saved'})", flush=True)
    if not profile.speed:
        print("the profile has no speed figures (older polytrain): predictions not rescaled")
    previous: dict[str, Any] = json.loads(Path(args.reuse).read_text()) if args.reuse else {}
    results: dict[str, Any] = {"profile": str(path), "models": {}, "summary": []}
    for model in models:
        job = job_from_fields(MODELS[model])
        t0 = time.perf_counter()
        counted = model_stats(job, device="cpu")  # real saved bytes (fused attention)
        timed = model_stats(job, device="cpu", measure=True, batch=8)
        print(f"{model}: stats in {time.perf_counter() - t0:.1f} s", flush=True)
        samples: list[dict[str, float]] = []  # [Note: rescaled to the runs' speed]
        if previous:
            stored = {
                _trial_name(t): t for t in previous["models"].get(model, {}).get("trials", [])
            }
            missing = [_name(lay) for lay in items if _name(lay) not in stored]
            if missing:
                raise SystemExit(
                    f"--reuse {args.reuse}: no {model} measurement of {', '.join(missing)}; "
                    "run without --reuse for those layouts"
                )
            trials = [stored[_name(lay)] for lay in items]
            samples = previous["models"][model].get("speed_samples", [])
        else:
            partitions = [p["partition"] for p in predict_all(counted, profile, job, items)]
            between = partial(sample_speed, profile, samples)
            trials = measure(model, items, partitions, args, between=between)
        speed = mean_ratios(profile, samples)
        moved = drifted(speed)
        off = f" ({', '.join(moved)} >15% off the profile)" if moved else ""
        print(f"  {model}'s runs: host at {describe(speed)}{off}", flush=True)
        preds = {
            "flops": predict_at_speed(counted, profile, job, items, speed),
            "measured": predict_at_speed(timed, profile, job, items, speed),
            "flops, as calibrated": predict_all(counted, profile, job, items),
        }
        rows = []
        for i, layout in enumerate(items):
            trial = trials[i]
            row: dict[str, Any] = {
                "name": _name(layout),
                "error": trial["error"],
                "peers": peer_estimates(counted, layout),
                "predicted": {},
            }
            own = _planner()["memory"].process_bytes(counted, profile)
            for variant, plist in preds.items():
                pv = plist[i]
                # The cost model's memory is model states + activations + buffers; a CPU
                # worker also holds the interpreter with torch, what its first optimizer and
                # step add, and its data set: `memory.process_bytes` ([Note: a worker's own
                # memory]), added here.
                row["predicted"][variant] = {
                    "step_s": pv["step_s"],
                    "states": pv["states"],
                    "server_states": pv["server_states"],
                    "peak": pv["memory_per_rank"] + own,
                    "breakdown": pv["breakdown"],
                }
            if not trial["error"]:
                row["measured"] = measured_figures(trial, layout)
            rows.append(row)
        results["models"][model] = {
            "trials": trials,
            "rows": rows,
            "speed_samples": samples,
            "speed_vs_profile": speed,
        }
        for variant in preds:
            print_rows(model, rows, variant)
            summary = report(model, rows, variant)
            results["summary"].append(summary)
            print(json.dumps(summary))
    print("\nREADME table:\n" + markdown_summary(results["summary"]))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    sys.exit(main())
