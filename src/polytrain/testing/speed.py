"""How much slower than a quiet reference machine this one runs now: deadlines in tests scale by it.

[Note: deadlines scale with machine speed] A test that turns a hang into an error needs a
deadline, and a deadline in plain seconds fails on a busy CI machine (two CPU hogs beside the
suite stretched a 5 s harness deadline past the healthy rank's start-up). `slowdown()` times a
fixed single-threaded CPU workload and compares it with two references:

- contention: the workload's wall time over the CPU time it actually got. On an idle core this
  is ~1; with other processes competing for the cores it is how many times longer everything
  takes (the scheduler's share), whatever the CPU.
- CPU speed: the CPU time over what the same workload took on the 2-core machine these tests
  were written on (`REFERENCE_CPU_S`), so a slower CPU also stretches deadlines (never shrinks
  them: a faster CPU keeps the written deadline).

The product is measured at most every `_MAX_AGE_S` seconds per process (a pytest session
re-measures as the load changes) and clamped to [1, `MAX_SLOWDOWN`]. `scaled(s)` is the
deadline to use. Assert an order of events rather than wall time wherever a test can.
"""

from __future__ import annotations

import statistics
import time

__all__ = ["MAX_SLOWDOWN", "REFERENCE_CPU_S", "scaled", "slowdown"]

REFERENCE_CPU_S = 0.04
"""CPU seconds of one `_workload` round on the reference machine (2 cores, idle)."""

MAX_SLOWDOWN = 30.0
_MAX_AGE_S = 30.0
_ROUNDS = 3

_cache: tuple[float, float] | None = None  # (measured at, slowdown)


def _workload() -> int:
    """A fixed, single-threaded pure-Python workload (no allocation-heavy or threaded code, so
    its CPU time does not depend on the allocator or on torch's thread pool)."""
    total = 0
    for i in range(400_000):
        total = (total + i * i) % 1_000_003
    return total


def _measure() -> float:
    walls, cpus = [], []
    for _ in range(_ROUNDS):
        w0, c0 = time.perf_counter(), time.process_time()
        _workload()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    wall, cpu = statistics.median(walls), max(statistics.median(cpus), 1e-6)
    contention = max(wall / cpu, 1.0)
    cpu_speed = max(cpu / REFERENCE_CPU_S, 1.0)
    return min(contention * cpu_speed, MAX_SLOWDOWN)


def slowdown(*, fresh: bool = False) -> float:
    """Factor (>= 1) by which this machine runs slower than the idle reference machine now."""
    global _cache
    now = time.monotonic()
    if fresh or _cache is None or now - _cache[0] > _MAX_AGE_S:
        _cache = (now, _measure())
    return _cache[1]


def scaled(seconds: float) -> float:
    """``seconds`` on the idle reference machine, stretched to this machine's current speed."""
    return seconds * slowdown()
