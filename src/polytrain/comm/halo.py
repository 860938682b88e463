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


class HaloRows:
    """The rows of the neighbouring bands, being received: `wait` before reading them."""

    def __init__(self, works: list[Any], sending: tuple[torch.Tensor, ...]) -> None:
        self.works, self.sending = works, sending  # sent tensors live until the sends finish

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.sending = [], ()


class _GradExchange:
    """The backward exchange of one `_HaloRows`, posted side by side as autograd produces each
    side's gradient, so it travels while the rest of the convolution's backward runs.

    [Note: backward halo overlap] Forward computes the interior rows first and the border rows
    last, so backward (newest first) reaches the border rows' convolution, and with it the
    gradients of the received rows, before the interior's, which is most of the work. A hook on
    each received-rows tensor posts that side's exchange the moment its gradient is ready;
    `_HaloRows.backward`, which autograd runs after the interior's backward (its node is older),
    only waits. Between two neighbours each direction carries one kind of message (gradients of
    ``above`` go up, of ``below`` go down), so the two posts may happen in either order on
    either rank.
    """

    def __init__(self, group: dist.ProcessGroup, x: torch.Tensor, top: int, bottom: int) -> None:
        b, c, _, w = x.shape
        self.group = group
        self.above_shape, self.below_shape = (b, c, top, w), (b, c, bottom, w)
        self.for_last = x.new_zeros(b, c, top, w)  # the band below's gradient of our last rows
        self.for_first = x.new_zeros(b, c, bottom, w)  # the band above's, of our first rows
        self.works: list[Any] = []
        self.sending: list[torch.Tensor] = []  # alive until the sends finish
        self.posted = {"up": False, "down": False}

    def up(self, grad_above: torch.Tensor | None) -> None:
        """Send the gradient of the rows from above back up; receive our last rows' gradient
        (None: no gradient reached those rows, zeros are sent)."""
        if not self.posted["up"]:
            self.posted["up"] = True
            grad = (
                self.for_last.new_zeros(self.above_shape)
                if grad_above is None
                else grad_above.contiguous()
            )
            self.sending.append(grad)
            self.works += _post(self.group, grad, None, None, self.for_last)

    def down(self, grad_below: torch.Tensor | None) -> None:
        """Send the gradient of the rows from below back down; receive our first rows'."""
        if not self.posted["down"]:
            self.posted["down"] = True
            grad = (
                self.for_first.new_zeros(self.below_shape)
                if grad_below is None
                else grad_below.contiguous()
            )
            self.sending.append(grad)
            self.works += _post(self.group, None, grad, self.for_first, None)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        for work in self.works:
            work.wait()
        self.works, self.sending = [], []
        return self.for_first, self.for_last


class _HaloRows(torch.autograd.Function):
    """Forward: posts the exchange and returns the (still arriving) rows from above and below,
    zeros at the image's borders; the caller computes what needs no halo, then waits
    ([Note: halo overlap] in `polytrain.parallel.spatial`). Backward: the gradients of those
    rows go back to their owners (posted early: [Note: backward halo overlap]) and are added to
    this band's border rows."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        top: int,
        bottom: int,
        group: dist.ProcessGroup,
        box: list[Any],
        grads: _GradExchange,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.top, ctx.bottom, ctx.h, ctx.grads = top, bottom, x.size(2), grads
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
    ) -> tuple[torch.Tensor, None, None, None, None, None]:
        top, bottom, h, grads = ctx.top, ctx.bottom, ctx.h, ctx.grads
        grads.up(grad_above)  # no-ops where the hooks posted already
        grads.down(grad_below)
        b, c, _, w = grads.above_shape
        grad_x = grads.for_last.new_zeros(b, c, h, w)
        for_first, for_last = grads.wait()
        if top:
            grad_x[:, :, h - top :] += for_last
        if bottom:
            grad_x[:, :, :bottom] += for_first
        return grad_x, None, None, None, None, None


def halo_rows(
    x: torch.Tensor, top: int, bottom: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, HaloRows]:
    """``(rows from above (B, C, top, W), rows from below (B, C, bottom, W), pending)``:
    the exchange is posted, not finished; call ``pending.wait()`` before reading the rows."""
    box: list[Any] = []
    grads = _GradExchange(group, x, top, bottom)
    above, below = _HaloRows.apply(x, top, bottom, group, box, grads)
    if above.requires_grad:  # [Note: backward halo overlap]
        above.register_hook(grads.up)
        below.register_hook(grads.down)
    return above, below, box[0]
