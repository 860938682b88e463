"""What a parameter server counts: its updates, messages, bytes, events, and per clock the
windows in which it moved that clock's data (written to ``<out_dir>/ps/server<i>.json``).

[Note: transfer windows] Per clock a server records (`TransferWindow`, in `ServerStats.windows`)
when the header of the first PUSH chunk of that clock arrived and when its last chunk was in
(over every worker; times from the receiver threads), when it posted the first reply to a PULL
of that clock and when every such reply had been sent, the bytes of each, and (sync) when the
update made from that clock's pushes started and ended. `ServerStats.window_bytes_per_s` divides
the bytes received and sent by the time inside those windows, summed over clocks: the server's
rate while it moves a step's data, where ``ps_bytes_per_s`` divides by its whole wall time.
With ``ps.overlap`` a push window opens at the first chunk, posted from inside backward, so it
also holds the rest of the workers' backward; a pull window holds only the sends, so the pull
windows alone (``which="pull"``) give the server's sending rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["ServerStats", "TransferWindow"]


@dataclass
class TransferWindow:
    """One clock's push and pull as a server saw them ([Note: transfer windows]); times are
    `time.perf_counter` seconds (on Linux one monotonic clock for every process of a host)."""

    push_start: float = math.inf  # the first PUSH chunk's header of this clock arrived
    push_end: float = -math.inf  # the last PUSH chunk of this clock was in
    push_bytes: int = 0
    pull_start: float = math.inf  # the first reply to a PULL of this clock was posted
    pull_end: float = -math.inf  # every reply to the PULLs of this clock was sent
    pull_bytes: int = 0
    apply_start: float = math.nan  # sync: the update made from this clock's pushes
    apply_end: float = math.nan

    def seconds(self, which: Literal["push", "pull", "both"] = "both") -> float:
        """The push window plus the pull window (``which``: only one; each 0 when this clock
        had none)."""
        push = max(0.0, self.push_end - self.push_start) if self.push_bytes else 0.0
        pull = max(0.0, self.pull_end - self.pull_start) if self.pull_bytes else 0.0
        return {"push": push, "pull": pull, "both": push + pull}[which]

    def moved(self, which: Literal["push", "pull", "both"] = "both") -> int:
        """Bytes received (push), sent (pull), or both."""
        push = self.push_bytes if which != "pull" else 0
        pull = self.pull_bytes if which != "push" else 0
        return push + pull

    def record(self) -> dict[str, float]:
        """JSON-ready fields (absent times dropped)."""
        out = {k: float(v) for k, v in vars(self).items()}
        return {k: v for k, v in out.items() if math.isfinite(v)}


@dataclass
class ServerStats:
    """What a server did; written to ``<out_dir>/ps/server<i>.json`` at the end."""

    updates: int = 0
    pushes: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    grants: int = 0
    events: list[tuple[int, int, int]] = field(default_factory=list)  # (worker, clock, min)
    joined: list[tuple[int, int]] = field(default_factory=list)  # (worker, start clock)
    removed: list[tuple[int, int, str]] = field(default_factory=list)  # (worker, clock, why)
    left: list[tuple[int, int]] = field(default_factory=list)  # (worker, clock)
    skipped: list[int] = field(default_factory=list)  # clocks of dropped non-finite updates
    windows: dict[int, TransferWindow] = field(default_factory=dict)  # by clock

    def window(self, clock: int) -> TransferWindow:
        return self.windows.setdefault(clock, TransferWindow())

    def window_bytes_per_s(
        self, first_clock: int = 1, which: Literal["push", "pull", "both"] = "both"
    ) -> float:
        """Bytes received and sent over the time inside the transfer windows of the clocks
        from ``first_clock`` on ([Note: transfer windows]); ``which``: the push windows'
        bytes over their time only, or the pull windows'; NaN if there were none."""
        chosen = [w for c, w in self.windows.items() if c >= first_clock]
        seconds = sum(w.seconds(which) for w in chosen)
        moved = sum(w.moved(which) for w in chosen)
        return moved / seconds if seconds > 0 else math.nan

    def record(self) -> dict[str, Any]:
        """JSON-ready counts, events and windows (the body of the server's stats file)."""
        return {
            "updates": self.updates,
            "pushes": self.pushes,
            "grants": self.grants,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "events": self.events,
            "max_staleness_by_worker": {
                str(w): max(c - m for v, c, m in self.events if v == w)
                for w in sorted({v for v, _, _ in self.events})
            },
            "joined": self.joined,
            "removed": self.removed,
            "left": self.left,
            "skipped": self.skipped,
            "windows": {str(c): w.record() for c, w in sorted(self.windows.items())},
            "window_bytes_per_s": self.window_bytes_per_s(),
            "push_window_bytes_per_s": self.window_bytes_per_s(which="push"),
            "pull_window_bytes_per_s": self.window_bytes_per_s(which="pull"),
        }
