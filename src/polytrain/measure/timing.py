"""Timing for `polytrain calibrate`: each figure measured in interleaved rounds, with its spread
([Note: timing rounds] on `Rounds`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

__all__ = [
    "ROUNDS",
    "Rounds",
    "median_and_spread",
    "synchronised_seconds",
    "timed",
    "timed_rounds",
]

Key = TypeVar("Key")


def timed(fn: Callable[[], object], device: torch.device, budget_s: float) -> float:
    """Seconds of one call of ``fn`` within ``budget_s`` (`Rounds` of ``fn`` alone)."""
    return timed_rounds({0: fn}, device, budget_s)[0][0]


ROUNDS = 5  # [Note: timing rounds]


class Rounds(Generic[Key]):
    """[Note: timing rounds] (seconds, spread) of one call of each of ``fns``, measured in
    ``rounds`` rounds: every round times each function in turn (2 to ``max_calls / rounds`` calls,
    about ``budget_s / rounds`` seconds of them: ``budget_s`` is per function) and keeps their
    median; a figure is the median of its round medians, and its spread their interquartile
    range over that median. `round` runs the next round (the caller spreads them over its
    work), `result` runs the rounds left and answers.

    On a host that others use, load comes in bursts of a fraction of a second to several
    seconds: one run of calls (what this was before) lands inside or outside a burst whole,
    and the matmul rate moved 65 -> 86 GFLOP/s between two calibrations a minute apart.
    Interleaving puts every size (every dtype) in the same stretches of load, so their ratios
    hold; `calibrate` spreads the matmul rounds over ~20 s of its other measurements, so a
    burst of a few seconds hits one or two rounds, which the median drops; the spread says how
    much load a figure met. The budget is one run's, so calibration takes no longer."""

    def __init__(
        self,
        fns: dict[Key, Callable[[], object]],
        device: torch.device,
        budget_s: float,
        rounds: int = ROUNDS,
        threads: int | None = None,
        max_calls: int = 50,
    ) -> None:
        self.fns, self.device, self.threads = fns, device, threads
        self.rounds = max(rounds, 1)
        self.share, self.cap = budget_s / self.rounds, max(2, max_calls // self.rounds)
        self.per_round: dict[Key, list[float]] = {key: [] for key in fns}
        self.warm = False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @property
    def done(self) -> bool:
        return len(next(iter(self.per_round.values()), [])) >= self.rounds

    def round(self) -> None:
        """One more round of every function (none once all are done)."""
        if self.done:
            return
        old = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            if not self.warm:  # allocations, first-call dispatch
                for fn in self.fns.values():
                    fn()
                self._sync()
                self.warm = True
            for key, fn in self.fns.items():
                times: list[float] = []
                while len(times) < 2 or (sum(times) < self.share and len(times) < self.cap):
                    t0 = time.perf_counter()
                    fn()
                    self._sync()
                    times.append(time.perf_counter() - t0)
                self.per_round[key].append(statistics.median(times))
        finally:
            torch.set_num_threads(old)

    def result(self) -> dict[Key, tuple[float, float]]:
        for _ in range(self.rounds):
            self.round()
        return {key: median_and_spread(values) for key, values in self.per_round.items()}


def timed_rounds(
    fns: dict[Key, Callable[[], object]],
    device: torch.device,
    budget_s: float,
    rounds: int = ROUNDS,
) -> dict[Key, tuple[float, float]]:
    """(seconds, spread) of each of ``fns``: `Rounds` run back to back."""
    return Rounds(fns, device, budget_s, rounds).result()


def median_and_spread(values: list[float]) -> tuple[float, float]:
    """(median, interquartile range / median) of ``values`` (spread 0 for fewer than 2)."""
    mid = statistics.median(values)
    if len(values) < 2 or mid <= 0:
        return mid, 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return mid, (q3 - q1) / mid


SYNCHRONISED_CALLS = 10  # timed calls of `synchronised_seconds` (every rank the same count)


def synchronised_seconds(step: Callable[[], None], calls: int = SYNCHRONISED_CALLS) -> float:
    """Mean seconds of ``step`` over ``calls`` calls, after two untimed ones, each call started
    together on every rank (a barrier); the slowest rank's figure. Every rank makes the same
    calls, so the distributed probes' collectives pair up."""
    step()
    step()
    total = 0.0
    for _ in range(calls):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step()
        total += time.perf_counter() - t0
    mean = torch.tensor([total / calls])
    torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.MAX)
    return float(mean.item())
