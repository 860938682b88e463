"""Collectives that autograd differentiates through (for statistics computed across replicas)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_reduce_sum_grad"]


class _AllReduceSum(torch.autograd.Function):
    """Forward: sum over the group. Backward: the gradient summed over the group as well.

    Every replica's loss depends on the summed value, so the gradient that reaches this replica's
    input is the sum of all replicas' gradients of that value (the adjoint of a sum-all-reduce).
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def all_reduce_sum_grad(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum of ``tensor`` over ``group``, differentiable (identity for one rank)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensor
    result: torch.Tensor = _AllReduceSum.apply(tensor, group)
    return result
