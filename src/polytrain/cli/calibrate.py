"""``polytrain calibrate``: measure this host for the planner and save the profile (JSON)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from polytrain.measure.calibrate import CalibrationPlan, cached_profile, steps_of
from polytrain.measure.host import speed_sample
from polytrain.planner.drift import DRIFT_LIMIT, SPEED_SPREAD, describe, drifted, speed_ratios
from polytrain.planner.types import Curve, HostProfile

__all__ = ["calibrate_command", "profile_table"]

BUSY_SPREAD = 0.2  # a figure whose rounds spread more than this met load (worth a re-run)


def _spread(profile: HostProfile, what: str) -> str:
    """`` (spread 4%)``: the interquartile range of the figure's timing rounds over its median
    ([Note: timing rounds] in measure/timing.py); empty where it was not recorded."""
    value = profile.spread.get(what)
    if value is None:
        return ""
    busy = ": a busy host? --force measures again" if value > BUSY_SPREAD else ""
    return f" (spread {100 * value:.0f}%{busy})"


def _size(nbytes: float) -> str:
    return f"{nbytes:.0f} B" if nbytes < 1024 else f"{nbytes / 1024:.0f} KiB"


def _points(curve: Curve, what: str) -> str:
    """``1.2 ms per 16 KiB unit, ...``: an in-step curve's measured points."""
    return ", ".join(f"{t * 1e3:.1f} ms per {_size(b)} {what}" for b, t in sorted(curve.points))


def profile_table(profile: HostProfile, path: Path) -> Table:
    table = Table(title=f"host profile {path}", show_header=False)
    table.add_row("device", f"{profile.device} ({profile.threads} thread(s) per process)")
    largest = {dtype: max(sizes, default=0) for dtype, sizes in profile.matmul_by_size.items()}
    for dtype, flops in profile.matmul_flops.items():
        where = _spread(profile, f"matmul {dtype} {largest.get(dtype, 0)}")
        table.add_row(f"matmul {dtype}", f"{flops / 1e9:.1f} GFLOP/s{where}")
    for dtype, sizes in profile.matmul_by_size.items():
        for n, flops in sorted(sizes.items()):
            if n != largest[dtype]:
                where = _spread(profile, f"matmul {dtype} {n}")
                table.add_row(f"matmul {dtype} {n}", f"{flops / 1e9:.1f} GFLOP/s{where}")
    table.add_row(
        "memory bandwidth",
        f"{profile.mem_bw / 1e9:.2f} GB/s{_spread(profile, 'memory bandwidth')}",
    )
    table.add_row("process start-up", f"{profile.startup_s:.2f} s")
    table.add_row("worker baseline memory", f"{profile.baseline_bytes / 2**20:.0f} MiB")
    table.add_row(
        "worker runtime memory (optimizer, first step)",
        f"{profile.runtime_bytes / 2**20:.0f} MiB",
    )
    for n, flops in sorted(profile.matmul_concurrent.items()):
        where = _spread(profile, f"matmul fp32, {n} at once")
        table.add_row(
            f"matmul fp32, {n} process(es) at once", f"{flops / 1e9:.1f} GFLOP/s each{where}"
        )
    for n, factor in sorted(profile.step_slowdown.items()):  # in measure/contention.py
        table.add_row(f"transformer layer step, {n} processes at once", f"{factor:.2f}x alone")
    for n, share in sorted(profile.step_skew.items()):  # [Note: ranks' skew]
        what = f"waiting for the slowest of {n} ranks every step"
        wait = profile.sync_wait_s.get(n)
        per_sync = f"{wait * 1e3:.2f} ms per synchronization + " if wait is not None else "+"
        table.add_row(what, f"{per_sync}{share:.1%} of the compute between")
    for n, secs in sorted(profile.dtensor_clip_call_s.items()):  # [Note: DTensor clip per call]
        table.add_row(f"clip over DTensor gradients, mesh of {n}", f"{secs * 1e3:.2f} ms per call")
    if profile.op_s > 0:
        table.add_row("operator call (dispatch)", f"{profile.op_s * 1e6:.1f} us")
    for n, flops in sorted(profile.gemm_by_size.items()):  # [Note: cold operands]
        where = _spread(profile, f"gemm fp32 {n}")
        what = f"Linear {n} -> {n}, 4096 rows, cold operands"
        table.add_row(what, f"{flops / 1e9:.1f} GFLOP/s{where}")
    for (t, d), (fwd, bwd) in sorted(profile.attention_rates.items()):  # [Note: attention kernels]
        where = _spread(profile, f"attention T{t} D{d}")
        table.add_row(
            f"attention T {t}, head {d}",
            f"{fwd / 1e9:.1f} GFLOP/s forward, {bwd / 1e9:.1f} backward{where}",
        )
    for op, secs in sorted(profile.elementwise_s.items()):  # [Note: elementwise kernels]
        table.add_row(op, f"{1 / secs / 1e9:.2f} G elements/s{_spread(profile, op)}")
    for stage, secs in sorted(profile.fsdp_unit_s.items()):
        what = f"zero {stage}" if stage else "replicate"
        table.add_row(f"FSDP2 hooks, {what}", f"{secs * 1e6:.0f} us per wrapped module")
    for stage, secs in sorted(profile.fsdp_tensor_s.items()):  # [Note: FSDP2 tensor overhead]
        what = f"zero {stage}" if stage else "replicate"
        table.add_row(f"FSDP2 per tensor, {what}", f"{secs * 1e6:.0f} us past a module's 2")
    if profile.tp_module_s > 0:
        table.add_row(
            "DTensor, tensor-parallel module", f"{profile.tp_module_s * 1e6:.0f} us per module"
        )
    for stage, curve in sorted(profile.fsdp_in_step.items()):  # in measure/probes.py
        table.add_row(f"FSDP2 zero {stage} collectives in a step, 2 ranks", _points(curve, "unit"))
    for ranks, curve in sorted(profile.tp_in_step.items()):  # in measure/probes.py
        what = f"tp all-reduce in a step, groups of 2, {ranks} ranks on the host"
        table.add_row(what, _points(curve, "activation"))
    for ranks, secs in sorted(profile.reduce_in_step.items()):  # in measure/contention.py
        what = f"end of step's all-reduce of a few floats in a step, {ranks} ranks"
        table.add_row(what, f"{secs * 1e3:.2f} ms")
    if profile.loop_step_s > 0 or profile.loop_microbatch_s > 0:
        table.add_row(
            "training loop's own Python",
            f"{profile.loop_step_s * 1e6:.0f} us per step + "
            f"{profile.loop_microbatch_s * 1e6:.0f} us per micro-batch"
            f"{_spread(profile, 'training loop')}",
        )
    for schedule, action in sorted(profile.pipe_action_s.items()):  # measure/calibrate_worker.py
        flush = profile.pipe_flush_s.get(schedule, 0.0)
        table.add_row(
            f"pipeline runtime, {schedule}, 2 stages",
            f"{action * 1e6:.0f} us per F and per B + {flush * 1e6:.0f} us per flush"
            f"{_spread(profile, f'pipeline runtime {schedule}')}",
        )
    for part, (per_tensor, per_byte) in profile.step_costs.items():
        rate = f"{1 / per_byte / 1e9:.2f} GB/s" if per_byte > 0 else "no per-byte term"
        table.add_row(f"end of step: {part}", f"{per_tensor * 1e6:.1f} us per tensor + {rate}")
    for mode, by_workers in profile.ps_exchange_s.items():
        for workers, secs in sorted(by_workers.items()):
            where = _spread(profile, f"ps exchange {mode} x{workers}")
            table.add_row(
                f"parameter server {mode}, {workers} worker(s)",
                f"{secs * 1e3:.2f} ms per step of fixed exchange{where}",
            )
    for op, by_world in profile.collectives.items():
        for world, curve in sorted(by_world.items()):
            small = min(curve.points)
            table.add_row(
                f"{op} world {world}",
                f"latency {small[1] * 1e6:.0f} us at {_size(small[0])}, "
                f"{curve.bandwidth / 1e9:.2f} GB/s at {max(curve.points)[0] / 2**20:.1f} MiB"
                f"{_spread(profile, f'{op} world {world}')}",
            )
    if profile.speed:  # [Note: host drift] in planner/drift.py
        table.add_row("speed figures", _speed(profile.speed))
    return table


_SPEED_UNITS = {
    "matmul fp32": (1e9, "GFLOP/s"),
    "matmul fp32, all cores": (1e9, "GFLOP/s"),
    "matmul half": (1e9, "GFLOP/s"),
    "operator": (1.0, "chains/s"),
    "copy": (1e9, "GB/s"),
}


def _speed(speed: dict[str, float]) -> str:
    """``matmul fp32 158 GFLOP/s, ...``: a profile's speed figures."""
    parts = []
    for name, value in speed.items():
        scale, unit = _SPEED_UNITS.get(name, (1.0, ""))
        parts.append(f"{name} {value / scale:,.0f} {unit}".rstrip())
    return ", ".join(parts)


def speed_warnings(profile: HostProfile) -> list[str]:
    """What to tell the user about a profile taken while the host changed speed."""
    moved = profile.spread.get(SPEED_SPREAD, 0.0)
    if moved <= DRIFT_LIMIT:
        return []
    return [
        f"the host's speed moved {100 * moved:.0f}% while calibrating (over "
        f"{100 * DRIFT_LIMIT:.0f}%): predictions may be off by as much; "
        "`polytrain calibrate --force` again when the host is quiet"
    ]


def calibrate_command(
    force: Annotated[bool, typer.Option(help="measure again even if a profile is saved")] = False,
    quick: Annotated[bool, typer.Option(help="small sizes, a few seconds (tests)")] = False,
    cache_dir: Annotated[
        Path | None, typer.Option(help="where profiles live (default $POLYTRAIN_CACHE)")
    ] = None,
    threads: Annotated[int, typer.Option(help="intra-op threads per process", min=1)] = 1,
    repeats: Annotated[
        int | None,
        typer.Option(
            help="whole calibrations in a row, each figure their median (default 3 on a CPU "
            "host, 1 on a GPU or with --quick)",
            min=1,
        ),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            help="time the speed figures now against the profile's; exit 1 when one moved "
            f"more than {100 * DRIFT_LIMIT:.0f}% (recalibrate with --force)"
        ),
    ] = False,
) -> None:
    """Measure matmul FLOP/s, memory bandwidth, collectives and start-up cost of this host."""
    plan = CalibrationPlan.quick() if quick else CalibrationPlan.for_this_host()
    if repeats is not None:
        plan = replace(plan, repeats=repeats)
    console = Console()
    with Progress(
        TextColumn("[bold]calibrate"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} {task.description}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("", total=steps_of(plan))
        profile, path, measured = cached_profile(
            plan,
            force=force,
            directory=cache_dir,
            threads=threads,
            on_progress=lambda what: progress.update(task, advance=1, description=what),
            saved_only=check and not force,
        )
        if not measured:
            progress.update(task, completed=steps_of(plan), description="saved profile reused")
    console.print(profile_table(profile, path))
    if not measured:
        console.print("(measured earlier on this hardware and torch; --force measures again)")
    elif plan.repeats > 1:
        console.print(f"(each figure the median of {plan.repeats} calibrations in a row)")
    for line in speed_warnings(profile):
        console.print(f"[bold]{line}[/bold]")
    if check:
        _check_speed(console, profile, threads)


def _check_speed(console: Console, profile: HostProfile, threads: int) -> None:
    """``--check``: [Note: host drift] in planner/drift.py."""
    if not profile.speed:
        console.print(
            "this profile has no speed figures (saved by an older polytrain): "
            "`polytrain calibrate --force` measures them"
        )
        raise typer.Exit(1)
    ratios = speed_ratios(profile.speed, speed_sample(threads))
    console.print(f"this host now against its profile: {describe(ratios)}")
    moved = drifted(ratios)
    if moved:
        console.print(
            f"[bold]{', '.join(moved)} moved more than {100 * DRIFT_LIMIT:.0f}%: predictions "
            "for this host are off by about as much; `polytrain calibrate --force` when the "
            "host is quiet (`plan --validate` rescales to the speed it finds)[/bold]"
        )
        raise typer.Exit(1)
