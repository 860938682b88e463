"""Small collectives the trainer needs, named for what they do."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_mean", "barrier", "broadcast_", "collective_device", "world_size"]


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a collective's tensors must live: NCCL moves only CUDA tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_mean(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place mean of ``tensor`` over ``group`` (a no-op for one rank)."""
    size = world_size(group)
    if size > 1:
        dist.all_reduce(tensor, group=group)
        tensor /= size
    return tensor


def broadcast_(tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    if world_size(group) > 1:
        dist.broadcast(tensor, src=src, group=group)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
