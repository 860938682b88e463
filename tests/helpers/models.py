"""User model factories for end-to-end tests (``--model tests.helpers.models:NAME``)."""

from __future__ import annotations

import torch
from torch import nn

from polytrain.data import DataSpec
from polytrain.models.base import BlockModel


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
    """Busy-wait for ``seconds`` of this process's CPU time."""
    import time

    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


class _Timed(nn.Module):
    """A block that takes ``seconds`` per forward, ``extra`` more while `profile_blocks` runs it.

    [Note: timed blocks] Under `profile_blocks` the block spins for ``seconds + extra`` of CPU
    time: the profile measures CPU time (one thread; `pipeline.profile`'s clock), so it sees
    exactly that however loaded the machine is. Anywhere else the block sleeps ``seconds``, like
    a host waiting for an accelerator: stages that sleep overlap whatever else the machine runs,
    so the pipeline's wall-clock step time keeps the partitions' differences. A CPU-bound block
    did not: on a machine with far more runnable processes than cores, two busy ranks share the
    CPU with everything else and every partition costs about the same total CPU time.
    """

    def __init__(self, width: int, seconds: float, extra: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.seconds, self.extra = seconds, extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        if _in_profile_blocks():
            _spin(self.seconds + self.extra)
        else:
            time.sleep(self.seconds)
        return self.fc(x)


def _in_profile_blocks() -> bool:
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "profile_blocks":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def timed_blocks(
    spec: DataSpec, seconds: list[float], extra: list[float] | None = None
) -> BlockModel:
    """A `BlockModel` whose block ``i`` busy-waits ``seconds[i]`` per forward (``extra[i]``
    more while `profile_blocks` runs it): the first block embeds, the last is the head."""
    width = 8
    extra = extra or [0.0] * len(seconds)
    embed = nn.Embedding(spec.vocab_size, width)
    blocks = [_Timed(width, s, e) for s, e in zip(seconds, extra, strict=True)]
    blocks[-1].fc = nn.Linear(width, spec.vocab_size)
    return BlockModel([nn.Sequential(embed, blocks[0]), *blocks[1:]])


def misprofiled(spec: DataSpec) -> nn.Module:
    """Six blocks of 10 ms each; block 1 looks 50 ms slower to the profiler than it is.

    The profile's best 2-stage split isolates block 1 ([2, 4]: 70 ms against 40, where [3, 3]
    would be 80 against 30); in the pipeline the balanced [3, 3] is ~25% faster (30 ms per stage
    and micro-batch, not 20 and 40), which only partition trials can see. [Note: timed blocks]
    """
    return timed_blocks(spec, [0.01] * 6, [0.0, 0.05, 0.0, 0.0, 0.0, 0.0])
