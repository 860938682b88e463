"""`polytrain calibrate`'s probes of per-tensor and per-module costs (torch-facing).

The end of a step over plain and over DTensor parameters ([Note: per-step costs], [Note:
DTensor end of step]), tensor parallelism's per-module dispatch ([Note: DTensor module
overhead]), FSDP2's hooks per unit and per tensor on one rank ([Note: FSDP2 unit overhead],
[Note: FSDP2 tensor overhead]) and its collectives inside a step on two ranks ([Note: FSDP2
collectives in a step]); `measure.calibrate` runs them and keeps their figures in the
`HostProfile`; tensor parallelism's collectives inside a step ([Note: tensor-parallel
collectives in a step]) on two ranks and on two groups of two. How
ranks on one host slow each other (shared cores, skew, the step's small reductions) is
`measure.contention`'s.

torch's FSDP and DTensor are imported inside the probes that use them: the CLI imports this
module ([Note: lazy torch.distributed] in _lazy_dist.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from polytrain._torch_private import replicate
from polytrain.config.job import OptimConfig
from polytrain.core.optim import build_optimizer
from polytrain.core.step import GradNorm, clip_gradients_, nonfinite_flag
from polytrain.measure.timing import synchronised_seconds, timed
from polytrain.parallel.grad_norm import grad_norm

__all__ = [
    "DTENSOR",
    "FSDP_PROBE_DIMS",
    "OPTIMIZERS",
    "STEP_PARTS",
    "TP_PROBE_ROWS",
    "fit_per_tensor_and_byte",
    "mean_costs",
    "rank_dtensor_clip_call",
    "rank_dtensor_step_costs",
    "rank_fsdp_in_step",
    "rank_fsdp_unit_s",
    "rank_tp_in_step",
    "rank_tp_module_s",
    "step_costs",
]

OPTIMIZERS: tuple[Literal["adamw", "sgd"], ...] = ("adamw", "sgd")
STEP_PARTS = ("check", "clip", *OPTIMIZERS)
FUSED_PARTS = ("adamw_fused", "sgd_fused")
DTENSOR = "dtensor "  # the prefix of a part's key measured on DTensor parameters


def fit_per_tensor_and_byte(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of ``seconds = a tensors + b bytes`` through (tensors, bytes, seconds)
    points, both coefficients kept >= 0 (a negative one is noise: refit with the other alone)."""
    stt = sum(n * n for n, _, _ in points)
    sbb = sum(b * b for _, b, _ in points)
    stb = sum(n * b for n, b, _ in points)
    sty = sum(n * y for n, _, y in points)
    sby = sum(b * y for _, b, y in points)
    det = stt * sbb - stb * stb
    a = (sty * sbb - sby * stb) / det if det else 0.0
    b = (sby * stt - sty * stb) / det if det else 0.0
    if a < 0 or not det:
        return 0.0, max(sby / sbb, 0.0) if sbb else 0.0
    if b < 0:
        return max(sty / stt, 0.0) if stt else 0.0, 0.0
    return a, b


def mean_costs(
    per_rank: list[dict[str, tuple[float, float]]],
) -> dict[str, tuple[float, float]]:
    """Each part's (per tensor, per byte) averaged over the ranks' `step_costs` figures."""
    parts = per_rank[0] if per_rank else {}
    return {
        part: (
            statistics.fmean(costs[part][0] for costs in per_rank),
            statistics.fmean(costs[part][1] for costs in per_rank),
        )
        for part in parts
    }


def step_costs(
    shapes: tuple[tuple[int, int], ...],
    device: torch.device,
    budget_s: float,
    *,
    make: Callable[[torch.Tensor], torch.Tensor] | None = None,
    norm: GradNorm | None = None,
    fused: bool = False,
    only: tuple[str, ...] = (),
) -> dict[str, tuple[float, float]]:
    """[Note: per-step costs] Each part of `core.step.finish_step`'s end of step, timed alone on
    synthetic fp32 parameters with gradients (the library's own functions and optimizers,
    default settings), fitted per tensor and per byte over ``shapes``. ``make`` turns each
    parameter's values (and its gradient's) into what the strategy holds (a DTensor), ``norm``
    is the clip's norm (the SPMD strategies' `parallel.grad_norm`). ``fused`` adds torch's fused
    AdamW and SGD (``"adamw_fused"``, ``"sgd_fused"``), which a parameter server runs ([Note:
    fused server optimizer] in ps/shard.py). ``only``: those parts alone (default: all)."""
    names = only or STEP_PARTS + (FUSED_PARTS if fused else ())
    points: dict[str, list[tuple[float, float, float]]] = {part: [] for part in names}
    wrap = make or (lambda t: t)
    for count, numel in shapes:
        params = [torch.nn.Parameter(wrap(torch.randn(numel, device=device))) for _ in range(count)]
        for prm in params:
            prm.grad = wrap(torch.randn(numel, device=device) * 1e-3)
        nbytes = float(count * numel * 4)
        for part in names:
            seconds = timed(_part_step(part, params, device, norm), device, budget_s)
            points[part].append((float(count), nbytes, seconds))
    return {part: fit_per_tensor_and_byte(pts) for part, pts in points.items()}


def _part_step(
    part: str, params: list[torch.nn.Parameter], device: torch.device, norm: GradNorm | None
) -> Callable[[], object]:
    """The call that times ``part`` of the end of step (a name of `STEP_PARTS` or
    `FUSED_PARTS`) over ``params``; an optimizer is built for its own part only."""
    if part == "check":
        return partial(nonfinite_flag, params, device)
    if part == "clip":
        return partial(clip_gradients_, params, 1.0, norm)
    for name in OPTIMIZERS:
        if part in (name, f"{name}_fused"):
            return build_optimizer(params, OptimConfig(name=name), fused=part != name).step
    raise ValueError(
        f"unknown end-of-step part {part!r}: expected one of {STEP_PARTS + FUSED_PARTS}"
    )


def rank_dtensor_step_costs(
    rank: int,
    world: int,
    shapes: tuple[tuple[int, int], ...],
    budget_s: float,
    parts: tuple[str, ...] = STEP_PARTS,
) -> dict[str, tuple[float, float]]:
    """[Note: DTensor end of step] The end-of-step ``parts`` of `step_costs` on DTensor
    parameters and gradients, keyed ``"dtensor <part>"``. ZeRO-2/3 (FSDP2) and tensor
    parallelism hold their parameters as DTensors; torch's CPU optimizers then run every
    per-tensor operator through DTensor's dispatch (sharding propagation in Python), which the
    plain-tensor figures do not include.

    Measured on a mesh of ``world`` ranks, every rank at once, each holding the shapes' values
    as its ``Shard(0)`` part (so a figure's bytes are one rank's, as the cost model passes
    them). The mesh's size matters: on this host (2026-11-26) AdamW on 8 DTensors took 1.2-1.3
    ms on a mesh of one rank, with or without a busy process beside it, and 1.6-2.6 ms on a
    mesh of two; the clip's norm 0.2-0.3 against 1.0-1.6 ms. `calibrate` runs the check and the
    optimizers on two ranks, the group a tensor-parallel or a ZeRO pair holds its DTensors on.
    The clip stays on a mesh of one rank: its norm communicates inside DTensor's operators
    (`parallel.grad_norm`), and the ranks' timing loops do not make matching calls; its call
    on several ranks is priced apart ([Note: DTensor clip per call]). The cost model still
    multiplies these figures by the shared-core factor (1.03-1.08 for two ranks here), so a
    pair's contention counts twice: small beside the mesh's own 1.7x. Run it under `testing.run_distributed`; each rank answers its own
    figures."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))

    def make(values: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(values, mesh, [Shard(0)], run_check=False)

    costs = step_costs(shapes, torch.device("cpu"), budget_s, make=make, norm=grad_norm, only=parts)
    return {DTENSOR + part: pair for part, pair in costs.items()}


# [Note: DTensor clip per call]
# The clip's norm over DTensor gradients (`parallel.grad_norm`: `get_total_norm` per mesh, then
# ``full_tensor()`` of the partial norm) costs a fixed time per call on a mesh of two or more
# ranks that neither the one-rank figures ([Note: DTensor end of step]) nor the all-reduce of a
# float between compute ([Note: the step's reductions in a step]) hold. On the 2-vCPU Xeon VM
# (2026-11-27, every call started from a barrier): clipping the four DTensor gradients of one
# column- then row-wise Linear pair took 0.45 ms on a mesh of one rank and 2.4 ms on a mesh of
# two, where a bare all-reduce of one float took 0.15 ms; with 12 pairs 1.6 and 3.0 ms. A
# phase trace of mlp tiny's tp2 step read the clip at 3.1 ms (priced ~0.8), and mlp tiny's
# tp2 and dp2 x tp2 were priced 28-43% low in every benchmark run. `rank_dtensor_clip_call`
# clips `_CLIP_PROBE_TENSORS` small DTensor gradients on a mesh of every rank, each count
# timed from a barrier, and answers the intercept of the line through the two: the per-call
# seconds (its all-reduce included). `calibrate` keeps it per world size
# (`HostProfile.dtensor_clip_call_s`); `Env.dtensor_clip_call_s` prices it once per step for
# a layout whose clip runs over DTensor gradients, in place of the clip's own small reduce.
_CLIP_PROBE_TENSORS = (2, 16)
_CLIP_PROBE_NUMEL = 1024


def rank_dtensor_clip_call(rank: int, world: int) -> float:
    """[Note: DTensor clip per call] Seconds per call of the clip over DTensor gradients on a
    mesh of ``world`` ranks beyond its per-tensor cost (the slowest rank's figure)."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)

    def dtensor(values: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(values, mesh, [Shard(0)], run_check=False)

    seconds = []
    for count in _CLIP_PROBE_TENSORS:
        params = [nn.Parameter(dtensor(torch.randn(_CLIP_PROBE_NUMEL))) for _ in range(count)]
        for prm in params:
            prm.grad = dtensor(torch.randn(_CLIP_PROBE_NUMEL) * 1e-3)

        def clip(params: list[nn.Parameter] = params) -> None:
            clip_gradients_(params, 1.0, grad_norm)

        seconds.append(synchronised_seconds(clip))
    (n1, n2), (s1, s2) = _CLIP_PROBE_TENSORS, seconds
    slope = max((s2 - s1) / (n2 - n1), 0.0)
    return max(s1 - slope * n1, 0.0)


def rank_tp_module_s(rank: int, world: int, budget_s: float) -> float:
    """[Note: DTensor module overhead] Seconds tensor parallelism adds per parallelized Linear to
    one forward + backward, on a mesh of ONE rank (its collectives move nothing; what is left
    is DTensor's dispatch: the styles' input and output hooks, ``from_local`` / ``to_local``
    and their autograd nodes, sharding propagation of the Linear's operators). The slope
    between 8 and 32 16-wide Linears (4 and 16 column-then-row pairs), each (parallelized
    minus the same model plain), per Linear. A group of one rank: run it under
    `testing.run_distributed`."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    device = torch.device("cpu")
    mesh = init_device_mesh("cpu", (1,))
    x = torch.ones(4, 16)

    def build(pairs: int) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(16, 16) for _ in range(2 * pairs)])

    def seconds(model: nn.Module) -> float:
        return timed(lambda: model(x).sum().backward(), device, budget_s)

    extra = []
    for pairs in (4, 16):
        plain = seconds(build(pairs))
        model = build(pairs)
        styles = {
            str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(2 * pairs)
        }
        parallelize_module(model, mesh, styles)  # type: ignore[arg-type]
        extra.append(seconds(model) - plain)
    return max((extra[1] - extra[0]) / 24, 0.0)


# [Note: FSDP2 collectives in a step]
# On a CPU host FSDP2's all-gathers and reduce-scatters block the computing thread ([Note: FSDP2
# on a CPU host] in cost/zero.py), and inside a step each costs more than the isolated calls
# of the collective curves: FSDP2 copies into and out of its flat buffers around them, and each
# rank waits for its peer's compute since the last one. Measured on the 2-core VM (2026-11-25
# evening, units of one Linear, two ranks, per unit beyond the same model unsharded): 448 x 448
# units (0.8 MB, gpt tiny's unit size): 5.3 ms (ZeRO-2) and 9.5 ms (ZeRO-3), where the hooks
# (0.4 ms, `fsdp_unit_s`) and the curves' prices of the unit's collectives (one or two
# all-gathers and a reduce-scatter) add to 3.7 and 4.9 ms; 16 x 16 units: 1.8 and 4.3 ms.
# `rank_fsdp_in_step` measures that per-unit figure on two ranks at two unit sizes and
# `calibrate` keeps, per stage, the line through them less the hooks: the in-step price of a
# unit's collectives by its parameter bytes (`HostProfile.fsdp_in_step`), which `zero_step`
# uses for data-parallel groups of two on the calibrated CPU host.
FSDP_PROBE_DIMS = (16, 448)  # Linear widths of the probe's units: ~1 KB and ~0.8 MB each
_FSDP_PROBE_UNITS = (4, 12)  # the per-unit figure is the slope between these unit counts
_FSDP_PROBE_ROWS = 64


def _linear_units(dim: int, units: int, linears: int = 1) -> nn.Sequential:
    """The FSDP2 probes' model: ``units`` units of ``linears`` Linears of width ``dim`` each
    (two parameter tensors per Linear), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(*[nn.Linear(dim, dim) for _ in range(linears)]) for _ in range(units)]
    )


def _shard_units(model: nn.Sequential, mesh: DeviceMesh, stage: int) -> nn.Sequential:
    """Wrap every unit, then the root (as apply_zero does): ZeRO-``stage`` (FSDP2's
    ``fully_shard``), or stage 0, FSDP2's ``replicate`` (data parallel over tensor-parallel
    ranks)."""
    from torch.distributed.fsdp import fully_shard

    for module in [*model, model]:
        if stage == 0:
            replicate(module, mesh=mesh)
        else:
            fully_shard(module, mesh=mesh, reshard_after_forward=stage == 3)
    return model


def _per_unit(
    seconds: Callable[[nn.Module], float],
    dim: int,
    counts: tuple[int, int],
    stages: tuple[int, ...],
    mesh: DeviceMesh,
    linears: int = 1,
) -> dict[int, float]:
    """Per stage, the seconds FSDP2 adds per unit of ``linears`` Linears of width ``dim``: the
    slope between the unit ``counts`` of (the wrapped model minus the same model unsharded,
    timed once per count)."""
    plain = {n: seconds(_linear_units(dim, n, linears)) for n in counts}
    out: dict[int, float] = {}
    for stage in stages:
        extra = [
            seconds(_shard_units(_linear_units(dim, n, linears), mesh, stage)) - plain[n]
            for n in counts
        ]
        out[stage] = max((extra[1] - extra[0]) / (counts[1] - counts[0]), 0.0)
    return out


# [Note: FSDP2 tensor overhead]
# FSDP2 copies a unit's parameters into and out of its flat all-gather and reduce-scatter
# buffers tensor by tensor, and its hooks walk them: a unit's overhead grows with its parameter
# tensors, not only with the unit. One-Linear units (two tensors) measured 0.4-0.5 ms each on
# the 2-vCPU Xeon VM (2026-11-27, ZeRO-2/3, one rank); units of six Linears (twelve tensors)
# 0.5-1.3 ms. A gpt tiny block holds twelve tensors, and its ZeRO-2/3 steps read 15-25% slower
# than priced in every benchmark run of 2026-11-26. `rank_fsdp_unit_s` also times units of
# `_FSDP_TENSOR_LINEARS` Linears and keeps, per stage, the difference per tensor beyond a
# one-Linear unit's two (`HostProfile.fsdp_tensor_s`); `Env.fsdp_overhead_s` adds it for the
# tensors a layout's units hold beyond two per unit.
_FSDP_TENSOR_LINEARS = 6


def rank_fsdp_unit_s(
    rank: int, world: int, budget_s: float
) -> tuple[dict[int, float], dict[int, float]]:
    """[Note: FSDP2 unit overhead] Seconds FSDP2 adds per wrapped module to one forward +
    backward, by ZeRO stage (0: its ``replicate``, which the hybrid runs for dp x tp), on a
    group of ONE rank: its collectives move nothing there, so what is left is its hooks' Python
    and bookkeeping, which the collective model does not price. The slope between 8 and 32
    one-Linear units, each (FSDP2 minus the same model unsharded); the root counts as one more
    unit. Second, per stage, the seconds per parameter tensor beyond a one-Linear unit's two
    ([Note: FSDP2 tensor overhead])."""
    device = torch.device("cpu")
    x = torch.ones(4, 16)

    def seconds(model: nn.Module) -> float:
        return timed(lambda: model(x).sum().backward(), device, budget_s)

    mesh = init_device_mesh("cpu", (1,))
    per_unit = _per_unit(seconds, 16, (8, 32), (0, 2, 3), mesh)
    wide = _per_unit(seconds, 16, (8, 32), (0, 2, 3), mesh, _FSDP_TENSOR_LINEARS)
    extra_tensors = 2 * (_FSDP_TENSOR_LINEARS - 1)
    per_tensor = {s: max((wide[s] - per_unit[s]) / extra_tensors, 0.0) for s in per_unit}
    return per_unit, per_tensor


def rank_fsdp_in_step(rank: int, world: int) -> dict[int, list[tuple[float, float]]]:
    """[Note: FSDP2 collectives in a step] Per ZeRO stage, (unit parameter bytes, seconds FSDP2
    adds per unit to one forward + backward) at each of `FSDP_PROBE_DIMS`, on ``world`` ranks
    (the slowest rank's figure)."""
    mesh = init_device_mesh("cpu", (world,))
    out: dict[int, list[tuple[float, float]]] = {}
    for dim in FSDP_PROBE_DIMS:
        x = torch.ones(_FSDP_PROBE_ROWS, dim)

        def seconds(model: nn.Module, x: torch.Tensor = x) -> float:
            # a fixed count of calls, not `timed`'s budget: every rank must make the same calls
            return synchronised_seconds(lambda: model(x).sum().backward())

        nbytes = float((dim * dim + dim) * 4)
        for stage, per_unit in _per_unit(seconds, dim, _FSDP_PROBE_UNITS, (2, 3), mesh).items():
            out.setdefault(stage, []).append((nbytes, per_unit))
    return out


# [Note: tensor-parallel collectives in a step]
# Tensor parallelism's all-reduces sit between dependent matmuls ([Note: tensor-parallel modules]
# in cost/tp.py) and, on a CPU host, cost more inside a step than the isolated calls of the
# collective curves: each waits for its peer's compute since the last one, DTensor copies around
# it, and with more ranks than cores the group's two processes are not scheduled together. On
# the 2-core VM gpt tiny's tp2 step measured 21% over its price at the isolated curves and
# dp2 x tp2 (four processes, two tp groups) 34% over (2026-11-25, `benchmarks/planner`).
# `rank_tp_in_step` runs column- then row-wise Linear pairs (one all-reduce of the activation in
# each pass, as in a transformer's MLP) of width `_TP_PROBE_DIM` at each of `TP_PROBE_ROWS`
# rows, on tp groups of two: alone (2 ranks) or two groups at once (4 ranks, as dp2 x tp2 runs);
# per pair beyond the same pairs' local shards unsharded, the slope between `_TP_PROBE_PAIRS`.
# `calibrate` keeps, per ranks on the host, half the pair's figure less one module's dispatch
# (`tp_module_s`, slowed by the shared cores): the in-step price of one all-reduce of that
# activation (`HostProfile.tp_in_step`), which `Env.tp_collective_s` uses for tp groups of two on
# the calibrated CPU host, scaling an all-gather by the isolated curves' ratio.
TP_PROBE_ROWS = (32, 2048)  # activations of 16 KB (mlp tiny) and 1 MiB (gpt tiny's 32 x 64)
_TP_PROBE_DIM = 128
_TP_PROBE_PAIRS = (4, 12)


def _linear_pairs(dim: int, pairs: int, shard: int) -> nn.Sequential:
    """``pairs`` (Linear(dim, dim / shard), Linear(dim / shard, dim)), seeded: the probe's
    model (``shard`` 1, parallelized after) or its local shards (``shard`` = the degree)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(pairs):
        layers += [nn.Linear(dim, dim // shard), nn.Linear(dim // shard, dim)]
    return nn.Sequential(*layers)


def rank_tp_in_step(rank: int, world: int) -> list[tuple[float, float]]:
    """[Note: tensor-parallel collectives in a step] (activation bytes, seconds tensor
    parallelism adds per column- then row-wise Linear pair to one forward + backward) at each of
    `TP_PROBE_ROWS`, on tp groups of two: the world's ranks in groups of two neighbours (a
    ``(world / 2, 2)`` mesh, tp last, as `topology.ParallelDims` lays them out); the slowest
    rank's figure."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = 2
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
    out = []
    for rows in TP_PROBE_ROWS:
        x = torch.ones(rows, _TP_PROBE_DIM)

        def seconds(model: nn.Module, x: torch.Tensor = x) -> float:
            return synchronised_seconds(lambda: model(x).sum().backward())

        extra = []
        for pairs in _TP_PROBE_PAIRS:
            local = seconds(_linear_pairs(_TP_PROBE_DIM, pairs, tp))
            model = _linear_pairs(_TP_PROBE_DIM, pairs, 1)
            styles = {
                str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                for i in range(2 * pairs)
            }
            parallelize_module(model, mesh, styles)  # type: ignore[arg-type]
            extra.append(seconds(model) - local)
        slope = (extra[1] - extra[0]) / (_TP_PROBE_PAIRS[1] - _TP_PROBE_PAIRS[0])
        out.append((float(rows * _TP_PROBE_DIM * 4), max(slope, 0.0)))
    return out
