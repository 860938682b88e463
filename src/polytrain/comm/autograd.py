"""Collectives that autograd differentiates through (rows gathered across ranks: hybrid, spatial)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_rows"]


class _AllGatherRows(torch.autograd.Function):
    """Forward: every rank's rows, concatenated in rank order along ``dim`` (0: batch rows,
    2: image rows). Backward: this rank's rows of the gradient, times ``grad_scale``.

    The backward is the mirror of the forward when the gradient that arrives is the same on
    every rank (the consumer all-reduced it, as a column-parallel layer's input does): each
    rank keeps the part that belongs to its own rows. See [Note: hybrid gradient scale] in
    `polytrain.parallel.hybrid` for ``grad_scale``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        group: dist.ProcessGroup | None,
        grad_scale: float,
        dim: int,
    ) -> torch.Tensor:
        size = dist.get_world_size(group)
        ctx.rows, ctx.rank, ctx.grad_scale = tensor.size(dim), dist.get_rank(group), grad_scale
        ctx.dim = dim
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        own = grad.narrow(ctx.dim, ctx.rank * ctx.rows, ctx.rows)
        return own * ctx.grad_scale, None, None, None


def all_gather_rows(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    grad_scale: float = 1.0,
    dim: int = 0,
) -> torch.Tensor:
    """The group's rows of ``tensor`` along ``dim`` (equal counts), differentiable
    (`_AllGatherRows`)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensor
    result: torch.Tensor = _AllGatherRows.apply(tensor, group, grad_scale, dim)
    return result
