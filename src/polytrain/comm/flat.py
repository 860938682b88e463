"""Collectives over many small tensors at once: one flat buffer, one all-reduce.

Used by the pipeline runtime, which owns no DDP wrapper: a stage's gradients are averaged over
its data-parallel peers after the flush, and the squared gradient norm and the loss are summed
over the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from polytrain.comm.collectives import world_size

__all__ = ["all_reduce_max_", "all_reduce_mean_flat_", "all_reduce_sum_", "all_reduce_sum_async_"]


def all_reduce_sum_(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place sum of ``tensor`` over ``group`` (a no-op for one rank)."""
    if world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


def all_reduce_max_(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place element-wise maximum of ``tensor`` over ``group`` (a no-op for one rank)."""
    if world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_reduce_sum_async_(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> Callable[[], torch.Tensor]:
    """Start an in-place sum of ``tensor`` over ``group``; the returned function waits for it."""
    if world_size(group) == 1:
        return lambda: tensor
    work = dist.all_reduce(tensor, group=group, async_op=True)

    def wait() -> torch.Tensor:
        if work is not None:
            work.wait()
        return tensor

    return wait


def all_reduce_mean_flat_(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> None:
    """Average every tensor of ``tensors`` in place over ``group`` with one all-reduce.

    Tensors are grouped by dtype and device; each group is flattened into one buffer.
    """
    size = world_size(group)
    if size == 1 or not tensors:
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for group_tensors in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        dist.all_reduce(flat, group=group)
        flat /= size
        offset = 0
        for t in group_tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
