"""One rank decides, every rank agrees: broadcast small integer lists and text as tensors.

Used where a decision depends on measurements that differ between ranks (the ``auto`` pipeline
partition): the source rank computes it and the others take its answer. Tensors only, no
pickling (``broadcast_object_list`` would unpickle what arrives).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from polytrain.comm.collectives import collective_device

__all__ = ["broadcast_ints", "broadcast_text", "is_main_rank"]


def _active(group: dist.ProcessGroup | None) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def is_main_rank() -> bool:
    """Global rank 0, or the only process when no group exists."""
    return not dist.is_initialized() or dist.get_rank() == 0


def broadcast_ints(
    values: Sequence[int] | None,
    length: int,
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
) -> list[int]:
    """``values`` (``length`` integers, given on ``src``) on every rank, as an int64 tensor."""
    if not _active(group):
        assert values is not None and len(values) == length
        return list(values)
    tensor = torch.zeros(length, dtype=torch.int64, device=collective_device(group))
    if dist.get_rank() == src:
        assert values is not None and len(values) == length
        tensor.copy_(torch.tensor(list(values), dtype=torch.int64))
    dist.broadcast(tensor, src=src, group=group)
    return [int(v) for v in tensor.tolist()]


def broadcast_text(text: str, *, src: int = 0, group: dist.ProcessGroup | None = None) -> str:
    """``src``'s ``text`` on every rank (UTF-8 bytes in a uint8 tensor, length sent first)."""
    if not _active(group):
        return text
    data = text.encode() if dist.get_rank() == src else b""
    (size,) = broadcast_ints([len(data)], 1, src=src, group=group)
    if size == 0:
        return ""
    tensor = torch.zeros(size, dtype=torch.uint8, device=collective_device(group))
    if dist.get_rank() == src:
        tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(tensor, src=src, group=group)
    return bytes(tensor.cpu().tolist()).decode()
