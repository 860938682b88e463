"""``polytrain sched``: share a cluster between training jobs (issue 40).

This module holds the ``sched`` sub-app and ``simulate``: a policy run over a job trace in
the discrete-event simulator, one row per policy. The local executor's commands
(``cli/sched_local.py``) and Slurm's (``cli/sched_slurm.py``) register on the same
``sched_app``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from polytrain.cli.sched_local import (
    cancel_command,
    logs_command,
    serve_command,
    status_command,
    submit_command,
)
from polytrain.cli.sched_slurm import slurm_script_command
from polytrain.errors import ConfigError
from polytrain.scheduler.durations import parse_duration
from polytrain.scheduler.policies import POLICIES, get_policy
from polytrain.scheduler.policy import Cluster
from polytrain.scheduler.report import Summary, plot_cdf
from polytrain.scheduler.simulate import DEFAULT_RESTART_S, SimResult, simulate
from polytrain.scheduler.speedup import PLAN_CLUSTER, Curves, planned_curves
from polytrain.scheduler.trace import fit_cluster, offered_load, read_trace, sample

__all__ = ["parse_policies", "parse_speedup", "sched_app", "simulate_command"]

sched_app = typer.Typer(
    name="sched",
    help="Share a cluster between training jobs: simulate policies on a trace, run jobs.",
    add_completion=False,
    no_args_is_help=True,
)


def parse_policies(values: list[str]) -> list[str]:
    """``--policy`` given repeatedly or as a comma list, in order, once each; default: all."""
    names = [n.strip() for v in values for n in v.split(",") if n.strip()] or list(POLICIES)
    for name in names:
        if name not in POLICIES:
            raise ConfigError(f"--policy {name!r}: choose from {', '.join(POLICIES)}")
    return list(dict.fromkeys(names))


def parse_speedup(value: str, devices: int) -> Curves | None:
    """``--speedup analytic`` (None: the analytic classes) or ``planner[:CLUSTER]``."""
    kind, _, cluster = value.partition(":")
    if kind == "analytic" and not cluster:
        return None
    if kind == "planner":
        return planned_curves(cluster or PLAN_CLUSTER, devices)
    raise ConfigError(
        f"--speedup {value!r}: choose analytic, planner or planner:CLUSTER (e.g. "
        f"planner:{PLAN_CLUSTER})"
    )


@sched_app.command("simulate")
def simulate_command(
    trace: Annotated[Path, typer.Option(help="job trace CSV (docs/scheduler.md, 'Traces')")],
    devices: Annotated[int, typer.Option(help="devices in the simulated cluster")],
    policy: Annotated[
        list[str],
        typer.Option(
            help="fifo, srtf, tiresias, gandiva, goodput (repeat or comma list; default all)"
        ),
    ] = [],  # noqa: B006 (typer reads the default; it is never mutated)
    slice_: Annotated[
        str, typer.Option("--slice", help="time slice: 40m, 1h, 90s, seconds")
    ] = "40m",
    restart: Annotated[
        str, typer.Option(help="what a preemption or resize costs a job (checkpoint + restart)")
    ] = f"{DEFAULT_RESTART_S:g}s",
    sample_: Annotated[
        int | None, typer.Option("--sample", help="simulate N jobs drawn at random (seeded)")
    ] = None,
    seed: Annotated[int, typer.Option(help="seed of --sample")] = 0,
    elastic: Annotated[
        float,
        typer.Option(
            help="let the goodput policy grow a job up to this many times its ask (Pollux sizes "
            "its jobs itself); 1 = every job runs on what it asks"
        ),
    ] = 1.0,
    speedup: Annotated[
        str,
        typer.Option(
            help="the jobs' speed-up curves: analytic (model classes), or planner[:CLUSTER] (each "
            f"class's model priced by the planner on CLUSTER, default {PLAN_CLUSTER})"
        ),
    ] = "analytic",
    drop_oversized: Annotated[
        bool, typer.Option(help="leave out jobs asking more devices than the cluster has")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    cdf: Annotated[
        Path | None, typer.Option(help="PNG of the JCT CDF per policy (never overwritten)")
    ] = None,
) -> None:
    """Simulate policies over a job trace: average and p99 JCT, makespan, utilisation, fairness."""
    names = parse_policies(policy)
    if devices < 1:
        raise ConfigError(f"--devices {devices}: give at least 1")
    cluster = Cluster(devices, parse_duration(slice_, "--slice"))
    restart_s = parse_duration(restart, "--restart", allow_zero=True)
    curves = parse_speedup(speedup, devices)
    if cdf is not None and cdf.exists():
        raise ConfigError(f"--cdf {str(cdf)!r} already exists: choose another path or remove it")
    jobs = read_trace(trace)
    if sample_ is not None:
        jobs = sample(jobs, sample_, seed)
    jobs, dropped = fit_cluster(jobs, devices, drop=drop_oversized)
    if not jobs:
        raise ConfigError(f"no job of {str(trace)!r} fits {devices} devices: give more --devices")
    results = {
        n: simulate(
            jobs, get_policy(n), cluster, restart_s=restart_s, elastic=elastic, curves=curves
        )
        for n in names
    }
    if cdf is not None:
        plot_cdf(
            {n: [r.jct for r in res.jobs] for n, res in results.items()},
            cdf,
            f"{trace.name}: {len(jobs)} jobs, {devices} devices, slice {cluster.slice_s:g} s",
        )
    setup = {
        "trace": str(trace),
        "jobs": len(jobs),
        "dropped_oversized": dropped,
        "devices": devices,
        "slice_s": cluster.slice_s,
        "restart_s": restart_s,
        "sample": sample_,
        "seed": seed,
        "offered_load": offered_load(jobs, devices),
        "speedup": speedup,
    }
    if as_json:
        out = {"setup": setup, "policies": {n: r.summary.as_dict() for n, r in results.items()}}
        typer.echo(json.dumps(out))
        return
    _print_table(setup, results)
    if cdf is not None:
        typer.echo(f"polytrain: CDF written to {cdf}")


def _print_table(setup: dict[str, object], results: dict[str, SimResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    load = float(setup["offered_load"])  # type: ignore[arg-type]
    title = (
        f"{setup['jobs']} jobs on {setup['devices']} devices (offered load {load:.2f}, "
        f"slice {setup['slice_s']:g} s, restart {setup['restart_s']:g} s"
        + (
            f", {setup['dropped_oversized']} oversized left out"
            if setup["dropped_oversized"]
            else ""
        )
        + ")"
    )
    table = Table(title=title)
    for column in (
        "policy",
        "avg JCT h",
        "p99 JCT h",
        "makespan h",
        "avg queue h",
        "util",
        "avg rho",
        "max rho",
        "preempt",
    ):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, result in results.items():
        s: Summary = result.summary
        table.add_row(
            name,
            f"{s.avg_jct_s / 3600:.2f}",
            f"{s.p99_jct_s / 3600:.1f}",
            f"{s.makespan_s / 3600:.1f}",
            f"{s.avg_queueing_s / 3600:.2f}",
            f"{s.utilisation:.2f}",
            f"{s.avg_rho:.2f}",
            f"{s.max_rho:.1f}",
            str(s.preemptions),
        )
    Console(width=120).print(table)


sched_app.command("serve")(serve_command)
sched_app.command("submit")(submit_command)
sched_app.command("status")(status_command)
sched_app.command("cancel")(cancel_command)
sched_app.command("logs")(logs_command)
sched_app.command("slurm-script")(slurm_script_command)
