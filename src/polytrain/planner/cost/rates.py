"""Reading calibrated tables: a rate at a size, on a grid, or at a count of processes.

Pure helpers over the dictionaries a `HostProfile` holds (measured point -> value), shared by
the cost model (`cost.common.Env`) and the calibration (`measure.calibrate`).
"""

from __future__ import annotations

import bisect
import math

__all__ = ["concurrent_rate", "grid_rate", "host_slowdown", "interpolated", "size_rate"]


def size_rate(by_size: dict[int, float], dim: float) -> float:
    """The calibrated matmul rate at size ``dim``: log-log interpolation between the measured
    sizes, clamped to their range; [Note: matmul size] in cost/common.py."""
    sizes = sorted(by_size)
    if dim <= sizes[0]:
        return by_size[sizes[0]]
    if dim >= sizes[-1]:
        return by_size[sizes[-1]]
    i = bisect.bisect_left(sizes, dim)
    lo, hi = sizes[i - 1], sizes[i]
    w = math.log(dim / lo) / math.log(hi / lo)
    return math.exp((1 - w) * math.log(by_size[lo]) + w * math.log(by_size[hi]))


def grid_rate(grid: dict[tuple[int, int], float], t: float, d: float) -> float:
    """The rate at (``t``, ``d``) of a calibrated grid (the product of two axes): bilinear in
    log-log between the measured points, clamped to their range; [Note: attention kernels] in
    measure/kernels.py."""
    ts, ds = sorted({k[0] for k in grid}), sorted({k[1] for k in grid})

    def bracket(axis: list[int], x: float) -> tuple[int, int, float]:
        x = min(max(x, axis[0]), axis[-1])
        i = min(bisect.bisect_left(axis, x), len(axis) - 1)
        lo, hi = axis[max(i - 1, 0)], axis[i]
        return lo, hi, math.log(x / lo) / math.log(hi / lo) if hi > lo else 0.0

    t0, t1, wt = bracket(ts, t)
    d0, d1, wd = bracket(ds, d)
    log = 0.0
    for tt, w1 in ((t0, 1 - wt), (t1, wt)):
        for dd, w2 in ((d0, 1 - wd), (d1, wd)):
            log += w1 * w2 * math.log(grid[(tt, dd)])
    return math.exp(log)


def concurrent_rate(measured: dict[int, float], n: float) -> float:
    """Per-process FLOP/s with ``n`` processes computing at once, from ``measured`` (process
    count -> per-process rate); see [Note: shared cores] in cost/common.py."""
    if not measured:
        raise ValueError("no concurrent matmul rates measured")
    n = max(n, 1)
    largest = max(measured)
    if n > largest:
        return measured[largest] * largest / n
    return interpolated(measured, n)


def interpolated(measured: dict[int, float], n: float) -> float:
    """``measured`` (count -> value) at ``n``: in proportion between the two measured counts
    around it, the nearest count's value outside them."""
    counts = sorted(measured)
    if n <= counts[0] or n >= counts[-1]:
        return measured[counts[0] if n <= counts[0] else counts[-1]]
    i = bisect.bisect_left(counts, n)
    lo, hi = counts[i - 1], counts[i]
    w = (n - lo) / (hi - lo)
    return measured[lo] * (1 - w) + measured[hi] * w


def host_slowdown(n: float, *, step: dict[int, float], matmul: dict[int, float]) -> float:
    """How much slower one process computes with ``n`` computing at once than alone (>= 1): the
    measured ``step`` slowdowns (count -> factor, [Note: shared cores, measured on a step] in
    measure/contention.py) read as rates 1 / factor (shared evenly past the largest count), else
    the concurrent ``matmul`` rates (count -> FLOP/s of each), else 1. [Note: shared cores] in
    cost/common.py."""
    rates = matmul
    if step:
        rates = {1: 1.0, **{k: 1.0 / v for k, v in step.items() if v > 0}}
    if not rates:
        return 1.0
    shared = concurrent_rate(rates, n)
    return max(concurrent_rate(rates, 1) / shared, 1.0) if shared > 0 else 1.0
