"""Metrics as JSON lines, one object per logged step, written by rank 0."""

from __future__ import annotations

import contextlib
import json
import resource
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from polytrain._lazy_dist import local_tensor
from polytrain.observe.trackers import Tracker, scalars

__all__ = [
    "MetricsWriter",
    "StateBytesAtUpdate",
    "compile_seconds",
    "model_state_bytes",
    "peak_memory_mb",
]


def _vm_hwm_kb() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak, or the resident-set high-water mark.

    [Note: inherited maxrss] On Linux ``ru_maxrss`` survives ``execve``: a worker started by a
    launcher that held 800 MB reports at least 800 MB. ``VmHWM`` belongs to this process image
    only, so it is read first."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    hwm = _vm_hwm_kb()
    if hwm is not None:
        return hwm / 2**10
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def _unique_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (each storage once: a DDP
    gradient is a view into its bucket, a stashed weight may share a parameter's storage)."""
    total = 0
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def model_state_bytes(
    modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None
) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state (local shards only),
    what the planner's model-state estimate predicts."""
    params = [p for m in modules for p in m.parameters()]
    seen: set[tuple[str, int]] = set()
    states = (
        [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        if optimizer is not None
        else []
    )
    return {
        "params": _unique_bytes(params, seen),
        "grads": _unique_bytes((p.grad for p in params if p.grad is not None), seen),
        "optimizer": _unique_bytes((v for v in states if v.numel() > 1), seen),
    }


class StateBytesAtUpdate:
    """[Note: model states at the update] The largest `model_state_bytes` seen just before an
    optimizer step (a step pre-hook, public ``Optimizer.register_step_pre_hook``), while the
    step's gradients are all held: what the planner's model-state estimate counts. After the
    step some strategies free them (PipeDream's update, FSDP2's ``replicate`` under the
    hybrid), so a reading taken then misses bytes the step held. Armed for the last step only,
    so the other steps' times pay nothing."""

    def __init__(self, modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None):
        self.modules = list(modules)
        self.optimizer = optimizer
        self.reading: dict[str, int] = {}
        self._handle: Any = None

    def arm(self) -> None:
        if self.optimizer is not None and self._handle is None:
            self._handle = self.optimizer.register_step_pre_hook(self._hook)

    def _hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        now = model_state_bytes(self.modules, optimizer)
        if sum(now.values()) > sum(self.reading.values()):
            self.reading = now

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def compile_seconds(step_times: list[float]) -> float | None:
    """Seconds the first step spent compiling: its time less the median of the later steps
    (None before a later step exists).

    [Note: compile time] Under ``train.compile`` each block is compiled when it first runs,
    inside the run's first step (forward and backward graphs alike), so that step is the only
    one that includes compilation: ``compile_s`` is its time over a steady step's, what the
    user waits for, measured with the same clock as step time and with no private counter.
    Evaluation's own compilation (``eval()`` mode is a new graph) falls outside every step.
    The rank summary's ``median_step_time_s`` leaves that first step out.
    """
    if len(step_times) < 2:
        return None
    later = sorted(step_times[1:])
    return max(0.0, step_times[0] - later[len(later) // 2])


class MetricsWriter:
    """Append JSON lines to ``path`` and hand each record's scalars to ``trackers``
    (`observe.trackers`); a no-op when ``path`` is None and there are no trackers (non-zero
    ranks). As a context manager it closes on leaving, the trackers' runs marked failed when an
    exception leaves."""

    def __init__(self, path: str | Path | None, trackers: Sequence[Tracker] = ()) -> None:
        self.path = Path(path) if path else None
        self._file: IO[str] | None = None
        self._trackers = list(trackers)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
        if self._trackers:
            values = scalars(record)
            for tracker in self._trackers:
                tracker.log(values, step=record["step"])

    def close(self, *, failed: bool = False) -> None:
        """Close the file and every tracker (each tried, the first error raised after)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        trackers, self._trackers = self._trackers, []
        error: BaseException | None = None
        for tracker in trackers:
            try:
                tracker.close(failed=failed)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # the exception leaving is the one to report
            self.close(failed=True)
