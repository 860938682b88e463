"""User model factories that misbehave on purpose (``--model tests.helpers.faults:NAME``).

Faults enter through the model, as they would in a user's job, never through switches in the
training code. Each is a small MLP (block size 16, the user-model default's data windows) with
one parameter-free block appended that counts training-mode forwards (one per step without
gradient accumulation) and acts at a chosen step on a chosen rank.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from polytrain.data import DataSpec
from polytrain.models.base import BlockModel
from polytrain.models.mlp import build_mlp

BLOCK_SIZE = 16  # pass model.block_size = 16 with these factories


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _PoisonGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by NaN."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class _Fault(nn.Module):
    """Acts on training-mode forward number ``step`` (1-based) on ``rank``."""

    def __init__(self, kind: str, step: int, rank: int | None, seconds: float = 0.0) -> None:
        super().__init__()
        self.kind, self.step, self.rank, self.seconds = kind, step, rank, seconds
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        self.calls += 1
        if self.kind == "slow":
            time.sleep(self.seconds)
            return x
        if self.calls != self.step or (self.rank is not None and _rank() != self.rank):
            return x
        if self.kind == "nan_loss":
            return x * float("nan")
        if self.kind == "nan_grad":
            return _PoisonGrad.apply(x)
        if self.kind == "hang":
            time.sleep(self.seconds)
        return x


def _model(spec: DataSpec, fault: _Fault) -> BlockModel:
    base = build_mlp(spec, n_layer=1, width=32, block_size=BLOCK_SIZE)
    return BlockModel([*base.blocks, fault], base.loss_fn)


def nan_loss_rank1_step3(spec: DataSpec) -> nn.Module:
    """Rank 1's output (so its loss) is NaN at step 3; rank 0's stays finite."""
    return _model(spec, _Fault("nan_loss", 3, rank=1))


def nan_grad_rank1_step3(spec: DataSpec) -> nn.Module:
    """Rank 1's gradients are NaN at step 3 while every loss stays finite."""
    return _model(spec, _Fault("nan_grad", 3, rank=1))


def hang_rank1_step3(spec: DataSpec) -> nn.Module:
    """Rank 1 stops participating (for an hour) in the forward of step 3."""
    return _model(spec, _Fault("hang", 3, rank=1, seconds=3600.0))


def slow(spec: DataSpec) -> nn.Module:
    """Every training step takes at least 50 ms (so a test can kill a worker mid-run)."""
    return _model(spec, _Fault("slow", 0, rank=None, seconds=0.05))


def steady(spec: DataSpec) -> nn.Module:
    """`slow` without its sleep: the same weights, the same steps, for a reference run."""
    return _model(spec, _Fault("none", 0, rank=None))


class _PoisonParamGrad(torch.autograd.Function):
    """Identity in ``x``; backward passes ``x``'s gradient through and makes ``w``'s NaN."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.full((1,), float("nan"), dtype=grad.dtype, device=grad.device)


class _ParamGradFault(nn.Module):
    """A block with one parameter whose gradient is NaN in training step ``step`` (1-based,
    ``per_step`` training forwards a step); everything else, the loss included, stays finite."""

    def __init__(self, step: int, per_step: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.step, self.per_step = step, per_step
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        self.calls += 1
        if (self.calls - 1) // self.per_step + 1 == self.step:
            return _PoisonParamGrad.apply(x, self.w)
        return x + self.w * 0.0


def nan_param_grad_first_block_step3_m2(spec: DataSpec) -> nn.Module:
    """Only the first pipeline stage's gradients (a parameter right after the embedding) are
    NaN at step 3, with 2 micro-batches a step; the gradient flowing back and the loss stay
    finite. Use with ``pipeline.partition = [2, 2]``."""
    base = build_mlp(spec, n_layer=1, width=32, block_size=BLOCK_SIZE)
    first, *rest = base.blocks
    return BlockModel([first, _ParamGradFault(3, per_step=2), *rest], base.loss_fn)
