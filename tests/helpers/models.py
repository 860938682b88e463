"""User model factories for end-to-end tests (``--model tests.helpers.models:NAME``)."""

from __future__ import annotations

import torch
from torch import nn

from polytrain.data import DataSpec


def sequential(spec: DataSpec) -> nn.Module:
    """A plain nn.Sequential user model: one block per child, cross-entropy loss."""
    return nn.Sequential(
        nn.Embedding(spec.vocab_size, 16),
        nn.Linear(16, 32),
        nn.GELU(),
        nn.Linear(32, spec.vocab_size),
    )


class _Exploding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the user model cannot run forward")


def exploding(spec: DataSpec) -> nn.Module:
    return _Exploding()


def _spin(seconds: float) -> None:
    """Busy-wait: costs CPU time, which the block profile measures (a sleep would not)."""
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Timed(nn.Module):
    """A block that takes ``seconds`` per forward, ``extra`` more while `profile_blocks` runs it."""

    def __init__(self, width: int, seconds: float, extra: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.seconds, self.extra = seconds, extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _spin(self.seconds + (self.extra if self.extra and _in_profile_blocks() else 0.0))
        return self.fc(x)


def _in_profile_blocks() -> bool:
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "profile_blocks":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def misprofiled(spec: DataSpec) -> nn.Module:
    """Six blocks of 5 ms each; block 1 looks 50 ms slower to the profiler than it is.

    The profile's best 2-stage split isolates block 1 ([2, 4]); in the pipeline the balanced
    [3, 3] is ~20% faster (15 ms per stage and micro-batch, not 10 and 20), which only
    partition trials can see. The blocks busy-wait on the wall clock, so a loaded machine
    stretches the difference less than it would stretch real compute.
    """
    from polytrain.models.base import BlockModel

    width = 8
    embed = nn.Embedding(spec.vocab_size, width)
    blocks = [_Timed(width, 0.005, 0.05 if i == 0 else 0.0) for i in range(4)]  # blocks 1-4
    head = _Timed(width, 0.005)
    head.fc = nn.Linear(width, spec.vocab_size)
    return BlockModel([nn.Sequential(embed, _Timed(width, 0.005)), *blocks, head])
