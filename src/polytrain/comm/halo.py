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

__all__ = ["HaloRows", "halo_rows"]


def _post(
    group: dist.ProcessGroup,
    to_up: torch.Tensor | None,
    to_down: torch.Tensor | None,
    from_up: torch.Tensor | None,
    from_down: torch.Tensor | None,
) -> list[Any]:
    """Post sends/receives with the band above (rank - 1) and below (rank + 1); None = nothing.
    Returns the works to wait on."""
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
    return list(dist.batch_isend_irecv(ops)) if ops else []


def _swap(
    group: dist.ProcessGroup,
    to_up: torch.Tensor | None,
    to_down: torch.Tensor | None,
    from_up: torch.Tensor | None,
    from_down: torch.Tensor | None,
) -> None:
    for work in _post(group, to_up, to_down, from_up, from_down):
        work.wait()


class HaloRows:
    """The rows of the neighbouring bands, being received: `wait` before reading them."""

    def __init__(self, works: list[Any], sending: tuple[torch.Tensor, ...]) -> None:
        self.works, self.sending = works, sending  # sent tensors live until the sends finish

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.sending = [], ()


class _HaloRows(torch.autograd.Function):
    """Forward: posts the exchange and returns the (still arriving) rows from above and below,
    zeros at the image's borders; the caller computes what needs no halo, then waits
    ([Note: halo overlap] in `polytrain.parallel.spatial`). Backward: the gradients of those
    rows go back to their owners and are added to this band's border rows."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, top: int, bottom: int, group: dist.ProcessGroup, box: list[Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.top, ctx.bottom, ctx.group, ctx.h = top, bottom, group, x.size(2)
        b, c, h, w = x.shape
        above = x.new_zeros(b, c, top, w)
        below = x.new_zeros(b, c, bottom, w)
        last = x[:, :, h - top :].contiguous()
        first = x[:, :, :bottom].contiguous()
        box.append(HaloRows(_post(group, first, last, above, below), (first, last)))
        return above, below

    @staticmethod
    def backward(
        ctx: Any, grad_above: torch.Tensor, grad_below: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None]:
        top, bottom, h = ctx.top, ctx.bottom, ctx.h
        b, c, _, w = grad_above.shape
        grad_x = grad_above.new_zeros(b, c, h, w)
        for_last = grad_above.new_zeros(b, c, top, w)
        for_first = grad_above.new_zeros(b, c, bottom, w)
        _swap(ctx.group, grad_above.contiguous(), grad_below.contiguous(), for_first, for_last)
        if top:
            grad_x[:, :, h - top :] += for_last
        if bottom:
            grad_x[:, :, :bottom] += for_first
        return grad_x, None, None, None, None


def halo_rows(
    x: torch.Tensor, top: int, bottom: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, HaloRows]:
    """``(rows from above (B, C, top, W), rows from below (B, C, bottom, W), pending)``:
    the exchange is posted, not finished; call ``pending.wait()`` before reading the rows."""
    box: list[Any] = []
    above, below = _HaloRows.apply(x, top, bottom, group, box)
    return above, below, box[0]
