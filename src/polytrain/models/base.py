"""`BlockModel`: a model as an ordered list of blocks plus a loss.

Pipelines cut the block list into stages, so every built-in model is written as blocks that take
one tensor and return one tensor. Parameter names are ``blocks.<i>.<...>`` whatever the layout,
which keeps exported weights comparable across strategies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BlockModel", "LossFn", "cross_entropy_loss"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: logits (..., V), targets (...)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


class BlockModel(nn.Module):
    def __init__(self, blocks: list[nn.Module], loss_fn: LossFn = cross_entropy_loss) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.loss_fn = loss_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)
