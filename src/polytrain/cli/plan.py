"""``polytrain plan``: how many devices, which layout, what step time, memory and cost.

Job flags are the `train` flags that describe the work (model, data, batch, steps, dtype,
optimizer, ``--config``, ``--set``); the planner chooses the parallel ones. A user mistake is
one line and exit code 2 (contract 6).
"""

from __future__ import annotations

import json
import math
import re
import shlex
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from polytrain.cli.plan_layout import layout_overrides, price_as_written
from polytrain.cli.plan_validate import validate_plans
from polytrain.cli.train import FLAG_FIELDS, resolve_job
from polytrain.config.job import JobConfig
from polytrain.errors import PlanError
from polytrain.measure.host import profile_for, speed_sample
from polytrain.measure.stats import model_stats
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.drift import DRIFT_LIMIT, describe, drifted, rescaled, speed_ratios
from polytrain.planner.memory import process_bytes
from polytrain.planner.search import Plan, PlanRequest, PlanResult, duration_text, search
from polytrain.planner.types import HostProfile, ModelStats
from polytrain.planner.validate import Trial, toml_value

__all__ = ["at_present_speed", "parse_deadline", "parse_devices", "plan_command", "stats_for_job"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def at_present_speed(profile: HostProfile) -> tuple[HostProfile, str]:
    """``profile`` rescaled to this host's speed figures timed now, and a line saying so
    ([Note: host drift] in planner/drift.py); a profile without speed figures as it is."""
    if not profile.speed:
        return profile, (
            "this profile has no speed figures (an older polytrain's): predictions at its "
            "calibrated speed; `polytrain calibrate --force` measures them"
        )
    ratios = speed_ratios(profile.speed, speed_sample(profile.threads))
    moved = drifted(ratios)
    why = f" ({', '.join(moved)} moved past {100 * DRIFT_LIMIT:.0f}%)" if moved else ""
    return rescaled(profile, ratios), (
        f"this host now against its profile: {describe(ratios)}{why}; predictions rescaled to it"
    )


def parse_deadline(text: str, now: datetime | None = None) -> float:
    """Seconds from now: a duration (``2h``, ``90m``, ``1.5h``, ``45s``, ``1d``) or an ISO time
    (``2026-11-24T09:00``, UTC unless it carries an offset) that must be in the future."""
    match = _DURATION.match(text)
    if match:
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
        if seconds <= 0:
            raise PlanError(
                f"--deadline {text!r} is not positive: give a duration such as 2h or 90m"
            )
        return seconds
    if text.strip().startswith("-"):
        raise PlanError(f"--deadline {text!r} is not positive: give a duration such as 2h or 90m")
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise PlanError(
            f"--deadline {text!r}: expected a duration (2h, 90m, 45s, 1d) or an ISO time such as "
            "2026-11-24T09:00"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    now = now or datetime.now(timezone.utc)
    seconds = (when - now).total_seconds()
    if seconds <= 0:
        raise PlanError(
            f"--deadline {text!r} is in the past (now {now:%Y-%m-%dT%H:%M} UTC): give a later time"
        )
    return seconds


def parse_devices(text: str | None) -> tuple[int, int]:
    """``N`` (exactly N) or ``MIN:MAX``; None = 1 to the whole cluster (0)."""
    if text is None:
        return 1, 0
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise PlanError(f"--devices {text!r}: expected N or MIN:MAX, e.g. 8 or 1:16") from None
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or values[0] < 1 or values[1] < values[0]:
        raise PlanError(f"--devices {text!r}: expected N or MIN:MAX with 1 <= MIN <= MAX")
    return values[0], values[1]


def stats_for_job(job: JobConfig) -> ModelStats:
    """The job's `ModelStats`, measured block by block on the meta device (`measure.stats`)."""
    return model_stats(job)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _money(cost: float | None) -> str:
    return "n/a" if cost is None else f"${cost:,.2f}"


def train_command_for(
    plan: Plan,
    job: JobConfig,
    config: Path | None,
    flags: dict[str, Any],
    sets: list[str],
    per_host: int,
) -> str:
    """The `polytrain train` command that runs ``plan``: the job as ``plan`` was given it, then
    the layout's fields that differ from the job's, as flags where a flag exists, else
    ``--set``."""
    words = ["polytrain", "train"]
    if config is not None:
        words += ["--config", str(config)]
    for name, value in flags.items():
        if value is not None:
            words += [f"--{name.replace('_', '-')}", str(value)]
    words += [w for s in sets for w in ("--set", s)]
    by_path = {path: flag for flag, path in FLAG_FIELDS.items()}
    for path, value in plan.prediction.layout.overrides(per_host).items():
        section, key = path.split(".")
        if getattr(getattr(job, section), key) == value:
            continue
        flag = by_path.get(path)
        option = f"--{(flag or '').replace('_', '-')}"
        if flag is not None and isinstance(value, bool):
            words.append(option if value else f"--no-{option[2:]}")
        elif flag is not None and not isinstance(value, list):
            words += [option, toml_value(value).strip('"')]
        else:
            words += ["--set", f"{path}={toml_value(value)}"]
    if plan.prediction.layout.overrides(per_host).get("launch.nnodes", 1) > 1:
        words += ["--rdzv-endpoint", "HOST:PORT", "--node-rank", "I"]
    return shlex.join(words)


def trial_to_dict(trial: Trial) -> dict[str, Any]:
    """One validation run, predicted against measured (seconds and bytes; NaN when failed)."""
    return {
        "layout": trial.spec.label,
        "predicted_step_s": trial.spec.predicted_step_s,
        "measured_step_s": None if trial.error else trial.measured_step_s,
        "peak_bytes": None if trial.error else trial.peak_bytes,
        "error": trial.error,
    }


def plan_to_dict(plan: Plan, global_batch: int, per_host: int = 0) -> dict[str, Any]:
    pred = plan.prediction
    timed = math.isfinite(pred.step_s)
    return {
        "layout": pred.layout.describe(),
        "overrides": pred.layout.overrides(per_host),
        "devices": plan.devices,
        "step_s": pred.step_s if timed else None,  # [Note: untimed layouts] in planner/search.py
        "samples_per_s": global_batch / pred.step_s if timed and pred.step_s else None,
        "memory_per_rank_bytes": pred.memory_per_rank,
        "fits": pred.fits,
        "total_s": plan.total_s if timed else None,
        "cost_usd": plan.cost if timed else None,
        "meets": plan.meets,
        "why": plan.why,
        "breakdown_s": {k: v for k, v in pred.breakdown.items() if not k.startswith("memory")},
    }


def _table(title: str, plans: list[Plan], global_batch: int) -> Table:
    table = Table(title=title)
    for col in (
        "#",
        "layout",
        "devices",
        "step",
        "samples/s",
        "memory/rank",
        "time to finish",
        "cost",
        "why not first",
    ):
        table.add_column(col, justify="right" if col not in ("layout", "why not first") else "left")
    for i, p in enumerate(plans, 1):
        pred = p.prediction
        timed = math.isfinite(pred.step_s)  # [Note: untimed layouts] in planner/search.py
        table.add_row(
            str(i),
            pred.layout.describe(),
            str(p.devices),
            f"{pred.step_s * 1e3:.1f} ms" if timed else "-",
            f"{global_batch / pred.step_s:,.1f}" if timed and pred.step_s else "-",
            _gib(pred.memory_per_rank),
            duration_text(p.total_s) if timed else "-",
            _money(p.cost) if timed else "-",
            p.why or ("chosen" if i == 1 and p.meets else ""),
        )
    return table


def _explain(best: Plan, result: PlanResult, device_key: str) -> str:
    b = best.prediction.breakdown
    step = best.prediction.step_s or 1.0
    parts = [f"compute {b.get('compute', 0) / step:.0%}"]
    for key, name in (
        ("bubble", "bubble"),
        ("dp_comm", "exposed gradient sync"),
        ("tp_comm", "tensor-parallel comm"),
    ):
        if b.get(key, 0) > 0:
            parts.append(f"{name} {b[key] / step:.0%}")
    goal = "the cheapest" if result.objective == "cost" else "the fastest"
    return (
        f"plan: {best.devices} x {device_key}, {best.layout.describe()}: {goal} layout that fits and meets "
        f"the limits; step {best.prediction.step_s * 1e3:.1f} ms ({', '.join(parts)}), "
        f"{duration_text(best.total_s)} to finish, {_money(best.cost)}"
    )


def plan_command(
    config: Annotated[Path | None, typer.Option(help="TOML job file")] = None,
    model: Annotated[str | None, typer.Option(help="gpt or mlp")] = None,
    size: Annotated[str | None, typer.Option(help="tiny, small or medium")] = None,
    data: Annotated[
        str | None, typer.Option(help="pydoc, or a .txt/.npy/.safetensors path")
    ] = None,
    steps: Annotated[int | None, typer.Option(help="optimizer steps")] = None,
    batch_size: Annotated[int | None, typer.Option(help="global batch size")] = None,
    dtype: Annotated[str | None, typer.Option(help="fp32 or bf16 autocast")] = None,
    optimizer: Annotated[str | None, typer.Option(help="adamw or sgd")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="section.key=value (repeatable)")
    ] = None,
    cluster: Annotated[
        str, typer.Option(help="catalog spec (4x8xH100:ib400) or cluster TOML")
    ] = "1x2xcpu",
    devices: Annotated[str | None, typer.Option(help="N or MIN:MAX devices to consider")] = None,
    deadline: Annotated[
        str | None, typer.Option(help="finish within: 2h, 90m, or an ISO time")
    ] = None,
    budget: Annotated[float | None, typer.Option(help="dollars the run may cost")] = None,
    objective: Annotated[
        str | None, typer.Option(help="time or cost (default: cost with --deadline, else time)")
    ] = None,
    allow_async: Annotated[
        bool,
        typer.Option(
            help="also price PipeDream, async/SSP parameter servers, gossip and local SGD "
            "(they do not reproduce the single-process run)"
        ),
    ] = False,
    json_: Annotated[bool, typer.Option("--json", help="print JSON for tools")] = False,
    top: Annotated[int, typer.Option(help="plans to show")] = 8,
    validate: Annotated[
        int, typer.Option(help="run the first K plans here and print predicted vs measured")
    ] = 0,
    new_schedules: Annotated[
        bool,
        typer.Option(
            help="also price interleaved 1F1B, ZB-H1 and ZBV pipelines (not yet calibrated: "
            "they take 1F1B's measured runtime cost per action)"
        ),
    ] = False,
    as_written: Annotated[
        bool,
        typer.Option(
            help="price the layout the job names (its parallel, pipeline and ps sections, "
            "from --config / --set) on the cluster instead of searching"
        ),
    ] = False,
    layout: Annotated[
        str | None,
        typer.Option(
            help="price this layout instead of searching, e.g. 'dp=8,zero=3' or "
            "'dp=2,tp=4,pp=4,schedule=interleaved-1f1b,v=2,micro=16,recompute=every:2' (keys: "
            "dp tp pp zero sync recompute schedule micro v accum servers mode)"
        ),
    ] = None,
) -> None:
    """Predict step time, memory and cost of every layout on a cluster, and pick one."""
    if budget is not None and budget < 0:
        raise PlanError(f"--budget {budget}: expected a non-negative number of dollars")
    if objective not in (None, "time", "cost"):
        raise PlanError(f"--objective {objective!r}: expected time or cost")
    if top < 1:
        raise PlanError(f"--top {top}: expected at least 1")
    if validate < 0:
        raise PlanError(f"--validate {validate}: expected the number of plans to run, at least 1")
    deadline_s = parse_deadline(deadline) if deadline is not None else None
    lo, hi = parse_devices(devices)
    clu = parse_cluster(cluster)
    if validate and clu.device.key != "cpu":
        raise PlanError(
            f"--validate {validate} runs plans on this host, but --cluster {cluster!r} is "
            "not this host's CPUs: plan with --cluster 1xNxcpu to validate here"
        )
    flags = {"model": model, "size": size, "data": data, "steps": steps, "batch_size": batch_size}
    flags |= {"dtype": dtype, "optimizer": optimizer}
    layout_sets = layout_overrides(layout) if layout is not None else []
    job = resolve_job(config, flags, [*(set_ or []), *layout_sets])
    stats = stats_for_job(job)
    profile = profile_for(clu.device.key)  # this host's, if calibrated and the same device
    speed_note = ""
    if validate and profile is not None:  # runs here now: price this host at its speed now
        profile, speed_note = at_present_speed(profile)
    request = PlanRequest(
        stats=stats,
        cluster=clu,
        global_batch=job.train.global_batch_size,
        steps=job.train.steps,
        min_devices=lo,
        max_devices=hi,
        dtype=job.train.dtype,
        objective=objective,  # type: ignore[arg-type]
        deadline_s=deadline_s,
        budget=budget,
        bucket_bytes=job.parallel.bucket_mb * 2**20,
        allow_async=allow_async,
        localsgd_period=job.localsgd.period,
        profile=profile,
        next_schedules=new_schedules,
    )
    if as_written or layout is not None:
        price_as_written(job, stats, clu, request, json_)
        return
    result = search(request)
    batch = job.train.global_batch_size
    source = (
        "this host's calibrated profile"
        if profile is not None
        else "catalog figures, uncalibrated (`polytrain calibrate` on the target measures it)"
    )
    command = (
        train_command_for(result.best, job, config, flags, set_ or [], clu.per_host)
        if result.best is not None
        else ""
    )
    if json_:
        trials: list[Trial] = []
        if validate and result.best is not None:  # the table goes to stderr, the rows here
            process = process_bytes(stats, request.profile) if request.profile else 0.0
            predictions = [p.prediction for p in result.plans]
            quiet = Console(stderr=True)
            trials = validate_plans(job, predictions, validate, process=process, console=quiet)
        out = {
            "model": stats.name,
            "params": stats.params,
            "cluster": clu.describe(),
            "objective": result.objective,
            "note": result.note,
            "best": plan_to_dict(result.best, batch, clu.per_host) if result.best else None,
            "plans": [plan_to_dict(p, batch, clu.per_host) for p in result.plans[:top]],
            "extremes": {
                k: plan_to_dict(p, batch, clu.per_host) for k, p in result.extremes.items()
            },
            "figures": source,
            "command": command,
            "validation": [trial_to_dict(t) for t in trials],
        }
        typer.echo(json.dumps(out, indent=2))
        return
    console = Console(width=None if Console().is_terminal else 150)
    console.print(
        f"{stats.name}: {stats.params / 1e6:,.1f} M parameters, batch {batch}, {job.train.steps} steps "
        f"on {clu.describe()} ({_money(clu.price_per_device_hour)} per device-hour)"
    )
    if result.best is not None:
        console.print(_explain(result.best, result, clu.device.key))
        console.print(_table("best plan and runners-up", result.plans[:top], batch))
        console.print(f"figures: {source}")
        console.print(f"run it: {command}", soft_wrap=True, highlight=False, markup=False)
        if validate:
            if speed_note:
                console.print(speed_note)
            process = process_bytes(stats, request.profile) if request.profile else 0.0
            validate_plans(job, [p.prediction for p in result.plans], validate, process=process)
        return
    console.print(f"[bold]{result.note}[/bold]")
    if result.extremes:
        console.print(_table("cheapest and fastest", list(result.extremes.values()), batch))
