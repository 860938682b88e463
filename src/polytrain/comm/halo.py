"""Halo exchange for spatially split images: each rank's band of rows gains its neighbours'
border rows before a convolution, and the gradient of those rows goes back in backward.

Seed 000's spatial model parallelism (and Dryden et al., "Improving strong-scaling of CNN
training by exploiting finer-grained parallelism", IPDPS 2019): an image's rows are split into
bands over the ranks of a group, in rank order. A convolution of kernel height K, stride S and
padding P needs, for the output rows of a band, P rows above the band and K - S - P rows below
it. The first rank's rows above and the last rank's rows below are the convolution's zero
padding. One `torch.distributed.batch_isend_irecv` per exchange, on a group of its own (so the
messages never meet DDP's gradient all-reduces on the data-parallel group).

Shapes: B batch, C channels, h band height, W width; top / bottom halo rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["halo_exchange"]


def _swap(
    group: dist.ProcessGroup,
    to_up: torch.Tensor | None,
    to_down: torch.Tensor | None,
    from_up: torch.Tensor | None,
    from_down: torch.Tensor | None,
) -> None:
    """Send/receive with the band above (rank - 1) and below (rank + 1); None = nothing."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ops = []
    for tensor, peer, op in (
        (to_up, rank - 1, dist.isend),
        (to_down, rank + 1, dist.isend),
        (from_up, rank - 1, dist.irecv),
        (from_down, rank + 1, dist.irecv),
    ):
        if tensor is not None and tensor.numel() and 0 <= peer < size:
            ops.append(dist.P2POp(op, tensor, dist.get_global_rank(group, peer), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _HaloExchange(torch.autograd.Function):
    """Forward: [rows from above (top), the band, rows from below (bottom)] along dim 2, zeros
    at the image's borders. Backward: the halo rows' gradients are sent back to the ranks that
    own those rows and added to their border rows' gradients (the adjoint of the copy)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, top: int, bottom: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.top, ctx.bottom, ctx.group = top, bottom, group
        b, c, _, w = x.shape
        above = x.new_zeros(b, c, top, w)
        below = x.new_zeros(b, c, bottom, w)
        last = x[:, :, x.size(2) - top :].contiguous()  # the band below reads them
        first = x[:, :, :bottom].contiguous()  # the band above reads them
        _swap(group, first, last, above, below)
        return torch.cat([above, x, below], dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        top, bottom = ctx.top, ctx.bottom
        h = grad.size(2) - top - bottom
        grad_x = grad[:, :, top : top + h].clone()
        b, c, _, w = grad.shape
        for_last = grad.new_zeros(b, c, top, w)  # the band below's gradient of my last rows
        for_first = grad.new_zeros(b, c, bottom, w)  # the band above's, of my first rows
        up = grad[:, :, :top].contiguous()
        down = grad[:, :, top + h :].contiguous()
        _swap(ctx.group, up, down, for_first, for_last)
        if top:
            grad_x[:, :, h - top :] += for_last
        if bottom:
            grad_x[:, :, :bottom] += for_first
        return grad_x, None, None, None


def halo_exchange(x: torch.Tensor, top: int, bottom: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` (B, C, h, W) with ``top`` rows of the band above and ``bottom`` of the band below
    (zeros beyond the image), differentiable; ``top, bottom <= h``."""
    result: torch.Tensor = _HaloExchange.apply(x, top, bottom, group)
    return result
