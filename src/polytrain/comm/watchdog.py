"""Hang diagnosis: turn a collective timeout into a message naming the ranks that did not arrive.

[Note: hang diagnosis] Gloo reports a stuck peer as "Timed out waiting 300000ms for recv
operation to complete", which names neither the operation nor the peer. Every rank therefore
checks in through the c10d store (the rendezvous key-value store, not the collective transport)
at the start of each step: ``alive/<rank> = step``. When a collective fails with a timeout or a
broken connection, the rank writes ``arrived/<rank>`` and waits a short grace period for the
other ranks that were waiting in the same collective to do the same. A rank that wrote nothing is
one that never arrived: it is stuck in computation, stopped, or dead; its last ``alive`` step
says how far it got. The store keys carry the elastic restart count, so a restarted group never
reads the previous attempt's marks.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch.distributed as dist

from polytrain._torch_private import default_store

__all__ = [
    "CollectiveTimeoutError",
    "Watchdog",
    "collective_timeout_s",
    "grace_s",
    "is_comm_failure",
]

_FAILURE_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete because some rank(s) did not take part in it."""


def grace_s(timeout_s: float) -> float:
    """How long a rank whose collective failed waits for the others to report arriving."""
    return min(5.0, max(0.5, 0.1 * timeout_s))


def collective_timeout_s(timeout_s: float) -> float:
    """The process-group timeout that, plus the grace period, fits in ``timeout_s``."""
    return max(timeout_s - grace_s(timeout_s), 0.5 * timeout_s)


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that timed out or lost a peer."""
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(word in text for word in _FAILURE_WORDS)


class Watchdog:
    """Per-step check-in and, on a failed collective, the list of ranks that never arrived."""

    def __init__(self, timeout_s: float) -> None:
        self.store = default_store()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.timeout_s = timeout_s
        self.grace_s = grace_s(timeout_s)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"polytrain/watchdog/{attempt}"
        self.enabled = self.store is not None and self.world_size > 1

    def check_in(self, step: int) -> None:
        """Record that this rank started ``step`` (0-based)."""
        if self.enabled:
            assert self.store is not None
            self.store.set(f"{self.prefix}/alive/{self.rank}", str(step))

    @contextlib.contextmanager
    def guard(self, operation: str) -> Iterator[None]:
        """Re-raise a collective failure inside the block as a `CollectiveTimeoutError`."""
        try:
            yield
        except RuntimeError as exc:
            if not self.enabled or not is_comm_failure(exc):
                raise
            raise CollectiveTimeoutError(self.diagnose(operation, exc)) from exc

    def _read(self, key: str) -> str | None:
        assert self.store is not None
        try:
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode()
        except Exception:  # the store itself may be unreachable when its host died
            return None

    def diagnose(self, operation: str, exc: BaseException) -> str:
        """Mark this rank as arrived, wait for the others to do the same, name the missing."""
        assert self.store is not None
        arrived_key = f"{self.prefix}/arrived"
        with contextlib.suppress(Exception):
            self.store.set(f"{arrived_key}/{self.rank}", operation)
        others = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + self.grace_s
        missing = others
        while missing and time.monotonic() < deadline:
            missing = [r for r in others if self._read(f"{arrived_key}/{r}") is None]
            if missing:
                time.sleep(0.1)
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not missing:
            return (
                f"{operation} failed on every rank ({cause}); no rank is missing: check the "
                "network between the hosts"
            )
        seen = []
        for r in missing:
            step = self._read(f"{self.prefix}/alive/{r}")
            seen.append(f"rank {r} (last started step {int(step) + 1})" if step else f"rank {r}")
        return (
            f"{operation} did not complete within launch.timeout_s = {self.timeout_s:g} s: "
            f"rank(s) {missing} did not arrive: {', '.join(seen)} ({cause}); see those "
            "ranks' logs, or raise --timeout if they are only slow"
        )
