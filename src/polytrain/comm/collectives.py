"""Tensor collectives over one process group, named for what they do (in place, no-ops alone).

Where a strategy has no DDP/FSDP wrapper to do it (the pipeline runtime, parameter-server
workers, the loop's own loss average), its reductions go through these: a mean or sum of one
tensor, a sum started without waiting, and many small tensors averaged through one flat buffer.
Every function is a no-op when the group has one rank (or no process group exists), so single
process runs call them unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_max_",
    "all_reduce_mean",
    "all_reduce_mean_flat_",
    "all_reduce_sum_",
    "all_reduce_sum_async_",
    "barrier",
    "collective_device",
    "world_size",
]


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (1 when no process group exists)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a collective's tensors must live: NCCL moves only CUDA tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_reduce_sum_(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place sum of ``tensor`` over ``group``."""
    if world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


def all_reduce_mean(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place mean of ``tensor`` over ``group``."""
    size = world_size(group)
    if size > 1:
        dist.all_reduce(tensor, group=group)
        tensor /= size
    return tensor


def all_reduce_max_(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place element-wise maximum of ``tensor`` over ``group``."""
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
    """Average every tensor of ``tensors`` in place over ``group`` with one all-reduce per kind.

    Tensors are grouped by dtype and device; each group is flattened into one buffer (one
    collective instead of one per parameter: the pipeline's dp all-reduce after its flush).
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
