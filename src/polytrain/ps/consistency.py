"""Consistency models of the parameter server as pure rules: sync, async and bounded staleness.

- ``sync`` (bulk synchronous): the server sums the pushes of clock ``c`` from every live worker
  and applies them once; nobody starts the next iteration before everybody finished this one.
  This is the strategy that reproduces the single-process run (ARCHITECTURE contract 1).
- ``async`` (asynchronous SGD, Downpour in DistBelief, Dean et al., NIPS 2012): each push is
  applied on arrival and workers never wait.
- ``ssp`` (stale synchronous parallel, Ho et al., "More Effective Distributed ML via a Stale
  Synchronous Parallel Parameter Server", NIPS 2013): pushes are applied on arrival, but the
  fastest worker may run at most ``s`` clocks ahead of the slowest. The bounded-delay
  consistency of Li et al., OSDI 2014, is the same rule.

No torch here: the server and worker runtimes call these rules, and tests check them in-process.

[Note: clocks] A worker's clock is the number of iterations it has completed (pushed and then
announced with `Op.CLOCK`); it starts at 0. "Worker at clock c" means it has completed ``c``
iterations and is about to run its next one. ``min_clock`` is the smallest clock over the live
workers.

[Note: SSP condition] Ho et al. (2013, section 2) require that a worker at clock ``c`` sees every
update from clocks ``[0, c - s - 1]`` of all workers, and that "the fastest and slowest threads
must be no more than s clocks apart". In the counting above: a worker at clock ``c`` may begin
its next iteration iff ``c - min_clock <= s``; otherwise it blocks until the slowest worker
catches up. With ``s = 0`` this is ``c <= min_clock``: every live worker has completed ``c``
iterations, which is exactly the bulk-synchronous barrier, so ``ssp`` with ``s = 0`` behaves
like ``sync`` (`apply_rule` then also aggregates, so stateful optimizers see the same updates).

[Note: membership] Workers may join and leave (elastic training). A leaving worker is no longer
waited for, neither by the clock barrier nor by the sync aggregator; a push it already made for
the current clock stays in the sum. A joining worker pulls the current parameters and starts at
the current ``min_clock`` (for sync: the clock being aggregated), so it never lowers the floor
that other workers wait on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Literal, get_args

from polytrain.errors import ConfigError, ProtocolError

__all__ = [
    "MODES",
    "ApplyRule",
    "ClockTable",
    "Mode",
    "StalenessViolation",
    "SyncAggregator",
    "apply_rule",
    "check_consistency",
    "check_staleness_trace",
    "may_proceed",
    "staleness_bound",
]

Mode = Literal["sync", "async", "ssp"]
MODES: tuple[str, ...] = get_args(Mode)


class ApplyRule(Enum):
    """When the server applies pushed gradients to its parameters."""

    SUM_THEN_APPLY = "sum_then_apply"
    """Sum the pushes of one clock from every live worker, then apply once (`SyncAggregator`)."""
    APPLY_ON_ARRIVAL = "apply_on_arrival"
    """Apply each push as soon as it arrives."""


def check_consistency(mode: str, staleness: int = 0) -> None:
    """Raise `ConfigError` unless ``(mode, staleness)`` is a valid ``ps.mode`` / ``ps.staleness``.

    ``staleness`` is the SSP bound ``s``; 0 (the config default) means "not set" for the other
    modes, and any other value with them is a mistake.
    """
    if mode not in MODES:
        raise ConfigError(f"ps.mode = {mode!r}: expected one of {', '.join(MODES)}")
    if not isinstance(staleness, int) or isinstance(staleness, bool):
        raise ConfigError(f"ps.staleness = {staleness!r}: expected an integer number of clocks")
    if staleness < 0:
        raise ConfigError(
            f"ps.staleness = {staleness}: expected a non-negative number of clocks "
            f"(0 means synchronous)"
        )
    if staleness != 0 and mode != "ssp":
        raise ConfigError(
            f"ps.staleness = {staleness} has no effect with ps.mode = {mode!r}: set "
            f"ps.mode = 'ssp' to bound staleness, or remove ps.staleness"
        )


def staleness_bound(mode: Mode, staleness: int = 0) -> int | None:
    """Largest allowed ``clock - min_clock`` when starting an iteration; None means unbounded."""
    check_consistency(mode, staleness)
    if mode == "async":
        return None
    return 0 if mode == "sync" else staleness


def may_proceed(mode: Mode, staleness: int, worker_clock: int, min_clock: int) -> bool:
    """Whether a worker at ``worker_clock`` may begin its next iteration.

    sync: ``worker_clock <= min_clock``; async: always; ssp with bound ``s``:
    ``worker_clock - min_clock <= s`` (see [Note: SSP condition]).
    """
    bound = staleness_bound(mode, staleness)
    return bound is None or worker_clock - min_clock <= bound


def apply_rule(mode: Mode, staleness: int = 0) -> ApplyRule:
    """How the server applies pushes under ``mode`` (``ssp`` with ``s = 0`` aggregates like sync)."""
    if staleness_bound(mode, staleness) == 0:
        return ApplyRule.SUM_THEN_APPLY
    return ApplyRule.APPLY_ON_ARRIVAL


class ClockTable:
    """Clock of every live worker (see [Note: clocks] and [Note: membership]).

    ``min_clock`` never decreases: clocks only advance, a leaving worker can only raise the
    minimum, and a joining worker starts at or above it. With no live worker it stays at the
    last minimum seen.
    """

    def __init__(self, workers: Iterable[int] = (), clock: int = 0) -> None:
        if clock < 0:
            raise ProtocolError(f"clock = {clock}: expected a non-negative clock")
        self._clocks: dict[int, int] = {}
        self._floor = clock
        for worker in workers:
            self.add_worker(worker, clock)

    def __contains__(self, worker: object) -> bool:
        return worker in self._clocks

    def __len__(self) -> int:
        return len(self._clocks)

    def __repr__(self) -> str:
        return f"ClockTable({dict(sorted(self._clocks.items()))})"

    @property
    def workers(self) -> list[int]:
        """Live workers in ascending order."""
        return sorted(self._clocks)

    def clock(self, worker: int) -> int:
        """Number of iterations ``worker`` has completed."""
        self._check_live(worker)
        return self._clocks[worker]

    def min_clock(self) -> int:
        """Smallest clock over the live workers (the last one seen when none is live)."""
        return min(self._clocks.values(), default=self._floor)

    def staleness(self, worker: int) -> int:
        """How many clocks ``worker`` is ahead of the slowest live worker."""
        return self.clock(worker) - self.min_clock()

    def advance(self, worker: int, finished: int | None = None) -> int:
        """Record that ``worker`` completed an iteration; return its new clock.

        ``finished`` is the clock the worker's `Op.CLOCK` message says it finished; when given,
        it must equal the worker's current clock.
        """
        current = self.clock(worker)
        if finished is not None and finished != current:
            raise ProtocolError(
                f"CLOCK from worker {worker} says it finished clock {finished}: expected "
                f"{current}; a clock message was lost or repeated"
            )
        self._clocks[worker] = current + 1
        self._floor = self.min_clock()
        return current + 1

    def add_worker(self, worker: int, clock: int | None = None) -> int:
        """Add a live worker at ``clock`` (default: the current ``min_clock``); return its clock."""
        if worker in self._clocks:
            raise ProtocolError(f"JOIN from worker {worker}: it is already live")
        if worker < 0:
            raise ProtocolError(f"JOIN from worker {worker}: expected a non-negative worker id")
        floor = self.min_clock()
        start = floor if clock is None else clock
        if start < floor:
            raise ProtocolError(
                f"JOIN from worker {worker} at clock {start}: expected a clock >= min_clock = "
                f"{floor}; a joining worker pulls the current parameters and starts there"
            )
        self._clocks[worker] = start
        return start

    def remove_worker(self, worker: int) -> None:
        """Forget ``worker``; nobody waits for it any more."""
        self._check_live(worker)
        self._floor = self.min_clock()
        del self._clocks[worker]
        self._floor = self.min_clock()

    def _check_live(self, worker: int) -> None:
        if worker not in self._clocks:
            raise ProtocolError(
                f"worker {worker} is not live: expected one of {self.workers}; it never joined "
                f"or has left"
            )


class SyncAggregator:
    """Bookkeeping of one sync-mode clock: who has pushed, who is still awaited.

    The server adds each push's gradient into its buffer and calls `add`; when `add` (or
    `remove_worker`) returns True it applies the sum once and calls `finish`, which starts the
    next clock. Only counts and ids live here; the tensors stay in the server.
    """

    def __init__(self, workers: Iterable[int], clock: int = 0) -> None:
        self._live: set[int] = set(workers)
        self._arrived: set[int] = set()
        self._clock = clock

    @property
    def clock(self) -> int:
        """The clock whose pushes are being collected."""
        return self._clock

    @property
    def live(self) -> frozenset[int]:
        return frozenset(self._live)

    @property
    def arrived(self) -> frozenset[int]:
        """Workers whose push of this clock is in the sum (including some that left since)."""
        return frozenset(self._arrived)

    @property
    def pending(self) -> frozenset[int]:
        """Live workers whose push of this clock has not arrived."""
        return frozenset(self._live - self._arrived)

    @property
    def ready(self) -> bool:
        """Every live worker has pushed (and at least one push is in the sum)."""
        return bool(self._arrived) and not self.pending

    def add(self, worker: int, clock: int) -> bool:
        """Record ``worker``'s push of ``clock``; return whether the sum is complete."""
        if worker not in self._live:
            raise ProtocolError(
                f"PUSH from worker {worker}: it is not live (live: {sorted(self._live)})"
            )
        if clock != self._clock:
            raise ProtocolError(
                f"PUSH from worker {worker} of clock {clock}: expected clock {self._clock}; in "
                f"sync mode a worker must not push ahead of or behind the barrier"
            )
        if worker in self._arrived:
            raise ProtocolError(
                f"PUSH from worker {worker} of clock {clock}: it already pushed this clock"
            )
        self._arrived.add(worker)
        return self.ready

    def add_worker(self, worker: int) -> int:
        """A worker joins at the clock being collected; return that clock."""
        assert not self.ready, "finish() the complete clock before changing membership"
        if worker in self._live:
            raise ProtocolError(f"JOIN from worker {worker}: it is already live")
        self._live.add(worker)
        return self._clock

    def remove_worker(self, worker: int) -> bool:
        """A worker leaves; stop waiting for it. Return whether the sum is now complete."""
        if worker not in self._live:
            raise ProtocolError(
                f"LEAVE from worker {worker}: it is not live (live: {sorted(self._live)})"
            )
        self._live.discard(worker)
        return self.ready

    def finish(self) -> int:
        """Close the complete clock; return how many pushes it summed, and start the next one."""
        assert self.ready, (
            f"clock {self._clock} is not complete: waiting for {sorted(self.pending)}"
        )
        num_pushes = len(self._arrived)
        self._arrived.clear()
        self._clock += 1
        return num_pushes


@dataclass(frozen=True)
class StalenessViolation:
    """A worker began an iteration further ahead of the slowest worker than the bound allows."""

    index: int
    worker: int
    clock: int
    min_clock: int
    bound: int

    @property
    def staleness(self) -> int:
        return self.clock - self.min_clock

    def __str__(self) -> str:
        return (
            f"event {self.index}: worker {self.worker} began at clock {self.clock} while the "
            f"slowest live worker was at clock {self.min_clock} (staleness {self.staleness} > "
            f"bound {self.bound})"
        )


def check_staleness_trace(
    events: Sequence[tuple[int, int, int]], bound: int
) -> list[StalenessViolation]:
    """Violations of the SSP condition in a recorded trace; empty means the trace is valid.

    Each event is ``(worker, clock, min_clock)``: the worker, at ``clock``, began an iteration
    while the slowest live worker was at ``min_clock``. Use ``bound = 0`` for sync mode.
    """
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
        raise ConfigError(f"staleness bound = {bound!r}: expected a non-negative integer")
    return [
        StalenessViolation(index=i, worker=worker, clock=clock, min_clock=floor, bound=bound)
        for i, (worker, clock, floor) in enumerate(events)
        if clock - floor > bound
    ]
