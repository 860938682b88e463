"""`polytrain calibrate`: measure this host once and keep the numbers (`HostProfile`).

What the cost model needs and cannot read from a data sheet: achieved (not peak) matmul FLOP/s
per dtype and size (alone and with N processes at once), memory bandwidth, the latency and
bandwidth of gloo collectives and p2p by message size and world size, what starting a process
group costs, how much memory a worker holds before it builds a model, and the end of a step
(non-finite check, clip, optimizer update) per tensor and per byte ([Note: per-step costs]),
on plain and on DTensor parameters, and DTensor's dispatch per tensor-parallel module (the
probes in `measure.probes`). Everything runs with the thread count a worker uses (one intra-op
thread per process: the launcher sets ``OMP_NUM_THREADS=1``). What a training worker itself
costs (its loop's own Python, its memory) is measured by `measure.calibrate_worker`, the wire's
figures (posted p2p, the parameter-server exchange) by `measure.calibrate_wire`, what several
ranks at once measure (the collectives' curves by world size, the ranks' contention, FSDP2's and
tensor parallelism's collectives inside a step) by `measure.calibrate_ranks`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from polytrain.comm.probe import COLLECTIVES
from polytrain.errors import PlanError
from polytrain.measure.calibrate_ranks import (
    matmul_rates,
    matmul_rounds,
    measure_fsdp_in_step,
    measure_tp_in_step,
    measure_worlds,
)
from polytrain.measure.calibrate_wire import PS_PROBE_WORKERS, posted_p2p_curve, ps_exchange
from polytrain.measure.calibrate_worker import (
    fit_pipeline_runtime,
    rank_baseline,
    rank_loop_overhead,
    rank_pipeline_steps,
)
from polytrain.measure.host import (
    host_identity,
    operator_chain,
    saved_profile,
    speed_rates,
    speed_rounds,
    speed_sample,
)
from polytrain.measure.kernels import OpCounter, rank_kernel_rates
from polytrain.measure.probes import (
    OPTIMIZERS,
    mean_costs,
    rank_dtensor_step_costs,
    rank_fsdp_unit_s,
    rank_tp_module_s,
    step_costs,
)
from polytrain.measure.timing import timed, timed_rounds
from polytrain.planner.cost.rates import host_slowdown
from polytrain.planner.drift import SPEED_SPREAD, speed_ratios
from polytrain.planner.profile_io import (
    cache_dir,
    fingerprint,
    load_profile,
    median_profile,
    profile_path,
    save_profile,
)
from polytrain.planner.search import SCHEDULES
from polytrain.planner.types import Curve, HostProfile
from polytrain.planner.worker_memory import fresh_worker_memory
from polytrain.testing.harness import run_distributed

__all__ = [
    "CalibrationPlan",
    "cached_profile",
    "calibrate",
    "host_identity",
    "saved_profile",
    "steps_of",
]

_KB = 1024
_MB = 1024 * _KB


@dataclass(frozen=True)
class CalibrationPlan:
    """What to measure; `quick` is a few seconds (tests), the default a few minutes."""

    matmul_sizes: tuple[int, ...] = (128, 256, 512, 1024)
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    copy_bytes: int = 256 * 2**20
    # 16 B (the end of step's [loss, flag] all-reduce: gloo's small-buffer regime, at world 4
    # on the 2-core VM ~1 ms where 4 KiB take 7-9 ms), then 4 KB .. 64 MB
    message_bytes: tuple[int, ...] = (16, *(4 * _KB * 4**i for i in range(8)))
    world_sizes: tuple[int, ...] = (2, 3, 4)
    budget_s: float = 0.5  # per (operation, size): at most ~this long once two calls are in
    # (tensors, fp32 values each) of the end-of-step probes: many small to few large tensors
    step_shapes: tuple[tuple[int, int], ...] = ((256, 64), (64, 4096), (4, 1 << 20))
    # workers at one server of the parameter-server probe ([Note: parameter-server exchange])
    ps_workers: tuple[int, ...] = PS_PROBE_WORKERS
    ps_rounds: int = 3  # launches of each (mode, workers); the figure is their median
    # a CPU host's kernels in a block: Linear weight sizes on cold operands ([Note: cold
    # operands] in measure/kernels.py), attention's sequence lengths x head sizes ([Note:
    # attention kernels]); () skips them (an accelerator host)
    gemm_sizes: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    attention_lengths: tuple[int, ...] = (32, 128)
    attention_heads: tuple[int, ...] = (32, 128)
    kernel_budget_s: float = 0.1  # per kernel shape
    # FSDP2's collectives inside a step on two ranks ([Note: FSDP2 collectives in a step] in
    # measure/probes.py), ~10 s
    fsdp_in_step: bool = True
    # tensor parallelism's all-reduces inside a step on tp groups of two, with each of these
    # rank counts on the host ([Note: tensor-parallel collectives in a step]), ~4 s and ~6 s
    tp_in_step_ranks: tuple[int, ...] = (2, 4)
    # the pipeline runtime's own cost per action and per flush, by schedule, on two stages
    # ([Note: pipeline runtime overhead] in measure/calibrate_worker.py)
    pipeline_schedules: tuple[str, ...] = SCHEDULES  # those the planner prices
    pipeline_steps: int = 40  # per round (6 rounds): ~25 s for the three schedules
    # whole calibrations in a row; each figure is their median ([Note: repeated calibrations]
    # in planner/profile_io.py): ~2 min each on the 2-core VM
    repeats: int = 3

    @staticmethod
    def quick() -> CalibrationPlan:
        return CalibrationPlan(
            gemm_sizes=(32, 128),
            attention_lengths=(16, 32),
            attention_heads=(16,),
            kernel_budget_s=0.02,
            step_shapes=((64, 64), (4, 16384)),
            matmul_sizes=(64, 128, 256),
            copy_bytes=8 * 2**20,
            message_bytes=(4 * _KB, 64 * _KB, 1024 * _KB),
            world_sizes=(2,),
            budget_s=0.05,
            ps_workers=(1,),
            ps_rounds=1,
            fsdp_in_step=False,
            tp_in_step_ranks=(2,),
            pipeline_schedules=("1f1b",),
            pipeline_steps=10,
            repeats=1,
        )

    @staticmethod
    def accelerator() -> CalibrationPlan:
        """A GPU host: matmuls up to 8192 (a GPU reaches its rate only at a few thousand), a
        1 GiB copy, larger end-of-step tensors, and no gloo collectives: GPU ranks talk NCCL,
        which the catalog's links price ([Note: asynchronous devices] in planner/cost/common.py
        for how the compute figures are used)."""
        return CalibrationPlan(
            matmul_sizes=(256, 512, 1024, 2048, 4096, 8192),
            copy_bytes=2**30,
            world_sizes=(),
            step_shapes=((256, 64), (64, 4096), (4, 1 << 22)),
            gemm_sizes=(),
            attention_lengths=(),
            repeats=1,  # a GPU is not shared with other tenants' processes
        )

    @staticmethod
    def for_this_host() -> CalibrationPlan:
        """`accelerator` where torch sees a GPU, else the CPU default."""
        return CalibrationPlan.accelerator() if torch.cuda.is_available() else CalibrationPlan()


def _mem_bw(nbytes: int, device: torch.device, budget_s: float) -> tuple[float, float]:
    """(bytes per second read and written by a copy, spread) ([Note: timing rounds])."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    secs, spread = timed_rounds({0: partial(dst.copy_, src)}, device, budget_s)[0]
    return 2.0 * nbytes / secs, spread  # read + write


def _op_seconds(device: torch.device, budget_s: float) -> float:
    """[Note: non-matmul time] Seconds per ATen operator call where the data is negligible: a
    forward and backward through 64 multiply-adds of 16 values, divided by the operator calls
    `measure.kernels.OpCounter` counts in it (the same counter the model statistics use)."""
    chain = operator_chain(device)
    counter = OpCounter()
    with counter:
        chain()
    return timed(chain, device, budget_s) / max(counter.ops, 1)


def calibrate(
    plan: CalibrationPlan | None = None,
    *,
    threads: int = 1,
    on_progress: Callable[[str], None] | None = None,
) -> HostProfile:
    """Measure this host (see the module docstring) ``plan.repeats`` times and keep each
    figure's median ([Note: repeated calibrations] in planner/profile_io.py); ``on_progress``
    hears each finished part of each repeat."""
    plan = plan or CalibrationPlan.for_this_host()
    tell = on_progress or (lambda _: None)
    runs = max(plan.repeats, 1)
    profiles = []
    for run in range(runs):
        prefix = f"({run + 1}/{runs}) " if runs > 1 else ""
        profiles.append(_measure(plan, threads, partial(_prefixed, tell, prefix)))
    return median_profile(profiles)


def _prefixed(tell: Callable[[str], None], prefix: str, what: str) -> None:
    tell(prefix + what)


def _measure(plan: CalibrationPlan, threads: int, tell: Callable[[str], None]) -> HostProfile:
    """One calibration of this host by ``plan``."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    speed = speed_rounds(threads)  # [Note: host drift] in planner/drift.py: beside the matmuls
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        spread: dict[str, float] = {}  # [Note: timing rounds]
        # the matmul rounds are spread over the measurements below (see `Rounds`)
        matmuls = matmul_rounds(plan.matmul_sizes, plan.dtypes, device, plan.budget_s, threads)
        matmuls.round()
        speed.round()
        mem_bw, spread["memory bandwidth"] = _mem_bw(plan.copy_bytes, device, plan.budget_s)
        tell("memory bandwidth")
        matmuls.round()
        speed.round()
        costs = step_costs(plan.step_shapes, device, plan.budget_s, fused=True)
        op_s = _op_seconds(device, plan.budget_s)
        tell("end of step: check, clip, optimizers; operator overhead")
    finally:
        torch.set_num_threads(old_threads)
    gemm: dict[int, float] = {}
    attention: dict[tuple[int, int], tuple[float, float]] = {}
    elementwise: dict[str, float] = {}
    if device.type == "cpu":  # [Note: kernels in a fresh process] in measure/kernels.py
        ((gemm, attention, elementwise, kernel_spread),) = run_distributed(
            rank_kernel_rates,
            1,
            threads,
            plan.gemm_sizes,
            plan.attention_lengths,
            plan.attention_heads,
            plan.kernel_budget_s,
            timeout_s=300.0,
        )
        spread.update(kernel_spread)
    tell("kernels: Linears on cold operands, attention, elementwise")
    matmuls.round()
    speed.round()
    ((fsdp_unit_s, fsdp_tensor_s),) = run_distributed(
        rank_fsdp_unit_s, 1, plan.budget_s, timeout_s=300.0
    )
    tell("FSDP2 overhead per unit")
    if device.type == "cpu":  # DTensor's dispatch: [Note: DTensor end of step], [Note: DTensor
        # module overhead] in measure/probes.py; an accelerator host: not measured yet
        shapes, budget = plan.step_shapes, plan.budget_s
        local = ("check", *OPTIMIZERS)  # nothing to communicate: on the pair's mesh
        pair = run_distributed(rank_dtensor_step_costs, 2, shapes, budget, local, timeout_s=300.0)
        (clip,) = run_distributed(
            rank_dtensor_step_costs, 1, shapes, budget, ("clip",), timeout_s=300.0
        )
        costs = {**costs, **mean_costs(pair), **clip}
        (tp_module_s,) = run_distributed(rank_tp_module_s, 1, plan.budget_s, timeout_s=300.0)
    else:
        tp_module_s = 0.0
    tell("DTensor overhead: end of step, tensor-parallel modules")
    matmuls.round()
    speed.round()
    if device.type == "cpu":  # [Note: loop overhead]; an accelerator host: not measured yet
        ((loop_step_s, loop_micro_s, spread["training loop"]),) = run_distributed(
            rank_loop_overhead, 1, plan.budget_s, op_s, costs, timeout_s=300.0
        )
    else:
        loop_step_s = loop_micro_s = 0.0
    tell("training loop overhead")

    t0 = time.perf_counter()
    group = max(run_distributed(rank_baseline, 2, timeout_s=300.0))
    fresh, runtime_bytes, after_imports_s = fresh_worker_memory()
    startup_s = time.perf_counter() - t0 - after_imports_s  # starting and importing only
    # the larger: a joined group's buffers (harness ranks) or a fresh worker's imports
    baseline = max(group, fresh)
    tell("process start-up")
    by_size: dict[str, dict[int, float]] = {dtype: {} for dtype in plan.dtypes}
    speed_figures = speed_rates(speed)  # their last round beside the matmuls' last
    for (dtype, n), (rate, rate_spread) in matmul_rates(matmuls).items():
        by_size[dtype][n] = rate
        spread[f"matmul {dtype} {n}"] = rate_spread
        tell(f"matmul {dtype} {n}")

    collectives: dict[str, dict[int, Curve]] = {op: {} for op in COLLECTIVES}
    ps_exchange_s: dict[str, dict[int, float]] = {}
    fsdp_in_step: dict[int, Curve] = {}
    if device.type == "cpu" and 2 in plan.world_sizes:  # measure/calibrate_wire.py
        posted, spread["p2p_posted world 2"] = posted_p2p_curve(plan.message_bytes)
        collectives["p2p_posted"] = {2: Curve(tuple(posted))}
        loop_s = loop_step_s + loop_micro_s
        ps_exchange_s, ps_spread = ps_exchange(op_s, loop_s, plan.ps_workers, plan.ps_rounds)
        spread.update(ps_spread)
        if plan.fsdp_in_step:
            fsdp_in_step = measure_fsdp_in_step(fsdp_unit_s)
        tell("posted p2p, parameter-server exchange, FSDP2 in a step")
    worlds = measure_worlds(
        plan.world_sizes, plan.message_bytes, plan.budget_s, max(plan.matmul_sizes), tell
    )
    for op, curves in worlds.collectives.items():
        collectives[op].update(curves)
    spread.update(worlds.spread)
    concurrent = {1: by_size["fp32"][max(plan.matmul_sizes)], **worlds.matmul_concurrent}
    slowdown = worlds.step_slowdown
    tp_in_step: dict[int, Curve] = {}
    if device.type == "cpu" and plan.tp_in_step_ranks:
        slower = partial(host_slowdown, step=slowdown, matmul=concurrent)
        tp_in_step = measure_tp_in_step(plan.tp_in_step_ranks, tp_module_s, slower)
        tell("tensor-parallel collectives in a step")

    identity = host_identity(threads)
    largest = max(plan.matmul_sizes)
    profile = HostProfile(
        fingerprint=fingerprint(identity),
        device=identity["gpu"] if device.type == "cuda" else "cpu",
        matmul_flops={dtype: sizes[largest] for dtype, sizes in by_size.items()},
        matmul_by_size=by_size,
        mem_bw=mem_bw,
        collectives=collectives,
        startup_s=startup_s,
        baseline_bytes=baseline,
        runtime_bytes=runtime_bytes,
        threads=threads,
        matmul_concurrent=concurrent,
        step_slowdown=slowdown,
        sync_wait_s=worlds.sync_wait,
        step_skew=worlds.step_skew,
        step_costs=costs,
        op_s=op_s,
        fsdp_unit_s=fsdp_unit_s,
        fsdp_tensor_s=fsdp_tensor_s,
        fsdp_in_step=fsdp_in_step,
        tp_module_s=tp_module_s,
        tp_in_step=tp_in_step,
        reduce_in_step=worlds.reduce_in_step,
        dtensor_clip_call_s=worlds.dtensor_clip_call,
        loop_step_s=loop_step_s,
        loop_microbatch_s=loop_micro_s,
        ps_exchange_s=ps_exchange_s,
        spread=spread,
        gemm_by_size=gemm,
        attention_rates=attention,
        elementwise_s=elementwise,
    )
    if device.type == "cpu" and plan.pipeline_schedules:  # priced by the profile so far
        measured = run_distributed(
            rank_pipeline_steps, 2, plan.pipeline_schedules, plan.pipeline_steps, timeout_s=300.0
        )[0]
        actions, flushes, pipe_spreads = fit_pipeline_runtime(profile, measured)
        profile = replace(
            profile,
            pipe_action_s=actions,
            pipe_flush_s=flushes,
            spread={**profile.spread, **pipe_spreads},
        )
        tell("pipeline runtime per action and per flush")
    return _with_speed(profile, speed_figures, speed_sample(threads))


def _with_speed(
    profile: HostProfile, rounds: dict[str, tuple[float, float]], end: dict[str, float]
) -> HostProfile:
    """``profile`` with its speed figures (``rounds``: `speed_rates`, timed beside the matmul
    rounds, so at the moments the compute figures were) and under ``spread["host speed during
    calibration"]`` how far the host's speed moved: the largest, over the figures, of their
    rounds' spread and of how far ``end`` (a sample at the calibration's end) is from them
    ([Note: host drift] in planner/drift.py)."""
    speed = {name: rate for name, (rate, _) in rounds.items()}
    moved = [spread for _, spread in rounds.values()]
    moved += [abs(r - 1.0) for r in speed_ratios(speed, end).values()]
    return replace(
        profile, speed=speed, spread={**profile.spread, SPEED_SPREAD: max(moved, default=0.0)}
    )


def steps_of(plan: CalibrationPlan) -> int:
    """How many times `calibrate` calls ``on_progress`` (the progress bar's total)."""
    cpu = not torch.cuda.is_available()
    wire = 1 if 2 in plan.world_sizes and cpu else 0
    tp = 1 if plan.tp_in_step_ranks and cpu else 0
    pipe = 1 if plan.pipeline_schedules and cpu else 0
    fixed = 7 + wire + tp + pipe
    once = len(plan.dtypes) * len(plan.matmul_sizes) + len(plan.world_sizes) + fixed
    return once * max(plan.repeats, 1)


def cached_profile(
    plan: CalibrationPlan | None = None,
    *,
    force: bool = False,
    directory: Path | None = None,
    threads: int = 1,
    on_progress: Callable[[str], None] | None = None,
    saved_only: bool = False,
) -> tuple[HostProfile, Path, bool]:
    """This host's saved profile, measured first when there is none or ``force``; returns the
    profile, its path and whether it was measured now. ``saved_only``: a `PlanError` instead of
    a measurement when none is saved."""
    identity = host_identity(threads)
    root = directory or cache_dir()
    if root.exists() and not root.is_dir():
        raise PlanError(
            f"profile cache {str(root)!r} is a file, not a directory: pass --cache-dir DIR or "
            "set POLYTRAIN_CACHE to a directory"
        )
    path = profile_path(fingerprint(identity), root)
    if path.exists() and not force:
        return load_profile(path), path, False
    if saved_only:
        raise PlanError(
            f"no saved profile of this host in {str(root)!r}: run `polytrain calibrate` first "
            "(--check times the speed figures against a saved profile)"
        )
    profile = calibrate(plan, threads=threads, on_progress=on_progress)
    save_profile(profile, path, identity)
    return profile, path, True
