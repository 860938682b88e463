"""Step results the loop has not read yet: read when it logs, and a non-blocking stop watch.

[Note: reading results late] A step ended on the device ([Note: the step stays on the device]
in `polytrain.core.step`) leaves its loss and non-finite flag on the device. The loop keeps
such steps here and reads them together when a record is written (every
``observe.log_every`` steps), before an evaluation or a checkpoint, and after the last step:
one wait for the device per logged window instead of one per step; the run's first step is read
alone (its warm-up and any compilation stay its own). On an asynchronous device
(CUDA) a step's host time is only the time to queue it, so every step of a window is given the
window's wall time divided by its steps (torchtitan logs the same mean); on the CPU, where a
step's host time is its whole time, each keeps its own.

Under ``train.on_nonfinite = "stop"`` each step's flag is copied into pinned host memory
without blocking; `PendingResults.stop_seen` looks at the copies that have landed (a CUDA
event, queried, never waited for) and, when one is set, the loop reads the window at once,
so the stop names its step a step or two after it ran. The non-finite update itself was never
applied (the fused optimizer skipped it on the device), and no checkpoint or export is written
before the window is read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

import torch

from polytrain.core.strategy import StepOutput

__all__ = ["PendingResults", "ReadStep"]


@dataclass(frozen=True)
class ReadStep:
    step: int  # 0-based
    out: StepOutput  # read: no ``complete`` left
    step_time_s: float


@dataclass
class _Watched:
    step: int
    host: torch.Tensor  # the flag's copy (pinned on CUDA)
    landed: torch.cuda.Event | None  # None: the copy is already there (CPU)


class PendingResults:
    """The steps run since the last read, in order ([Note: reading results late])."""

    def __init__(self, device: torch.device, *, stop: bool) -> None:
        self.asynchronous = device.type == "cuda"
        self.stop = stop
        self._steps: list[tuple[int, StepOutput, float]] = []
        self._watched: list[_Watched] = []
        self._window_start = time.perf_counter()

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int, out: StepOutput, host_time_s: float) -> None:
        self._steps.append((step, out, host_time_s))
        if self.stop and out.flag is not None:
            self._watch(step, out.flag)

    def _watch(self, step: int, flag: torch.Tensor) -> None:
        if flag.device.type != "cuda":
            self._watched.append(_Watched(step, flag, None))
            return
        host = torch.empty((), dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._watched.append(_Watched(step, host, event))

    def stop_seen(self) -> bool:
        """Whether a landed flag copy shows a non-finite step (never waits for the device)."""
        while self._watched:
            first = self._watched[0]
            if first.landed is not None and not first.landed.query():
                return False
            self._watched.pop(0)
            if float(first.host) > 0:
                return True
        return False

    def unread_without_flag(self) -> bool:
        """A step before the newest that returned ``complete`` without ``flag`` (PipeDream's
        stream): the loop reads it now that the next step has started."""
        return len(self._steps) > 1 and self._steps[-2][1].flag is None

    def read(
        self, guard: Callable[[str], AbstractContextManager[object]], *, keep_newest: bool = False
    ) -> list[ReadStep]:
        """Read the pending steps (all, or all but the newest), in order. ``guard(what)`` wraps
        each wait ([Note: hang diagnosis] in `polytrain.comm.watchdog`)."""
        cut = len(self._steps) - 1 if keep_newest else len(self._steps)
        taken, self._steps = self._steps[:cut], self._steps[cut:]
        outs = []
        for step, out, _ in taken:
            if out.complete is not None:
                with guard(f"the end of train step {step + 1}"):
                    done = out.complete()
                out = replace(done, metrics={**out.metrics, **done.metrics})
            outs.append(out)
        self._watched = [w for w in self._watched if w.step > taken[-1][0]] if taken else []
        now = time.perf_counter()
        window = (now - self._window_start) / max(len(taken), 1)
        self._window_start = now
        return [
            ReadStep(step, out, window if self.asynchronous else host_s)
            for (step, _, host_s), out in zip(taken, outs, strict=True)
        ]

    def restart_window(self) -> None:
        """Start the next window's clock now (after an evaluation or a checkpoint, whose time
        belongs to no step)."""
        self._window_start = time.perf_counter()
