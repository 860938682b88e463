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
