"""Ranks agreeing on small values: integer lists and text moved as tensors, never pickled.

The c10d object collectives (``all_gather_object``, ``broadcast_object_list``) pickle their
payload over the network; these move int64 (or UTF-8 uint8) tensors only, so a peer can send
nothing but numbers. Two uses: one rank decides and the others take its answer (the ``auto``
pipeline partition: `broadcast_ints`, `broadcast_text`), and every rank reports and all compare
(checkpoint steps and layouts: `all_gather_ints`, `differing_ranks`, `fingerprint`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from polytrain.comm.collectives import collective_device, world_size

__all__ = [
    "all_gather_ints",
    "broadcast_int",
    "broadcast_ints",
    "broadcast_text",
    "differing_ranks",
    "fingerprint",
    "is_main_rank",
]


def is_main_rank() -> bool:
    """Global rank 0, or the only process when no group exists."""
    return not dist.is_initialized() or dist.get_rank() == 0


def fingerprint(text: str) -> int:
    """A signed 63-bit digest of ``text`` (sha256), small enough for an int64 tensor."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def broadcast_ints(
    values: Sequence[int] | None,
    length: int,
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
) -> list[int]:
    """``values`` (``length`` integers, given on ``src``) on every rank, as an int64 tensor."""
    if world_size(group) == 1:
        assert values is not None and len(values) == length
        return list(values)
    tensor = torch.zeros(length, dtype=torch.int64, device=collective_device(group))
    if dist.get_rank() == src:
        assert values is not None and len(values) == length
        tensor.copy_(torch.tensor(list(values), dtype=torch.int64))
    dist.broadcast(tensor, src=src, group=group)
    return [int(v) for v in tensor.tolist()]


def broadcast_int(value: int, src: int = 0, group: dist.ProcessGroup | None = None) -> int:
    """Rank ``src``'s ``value`` on every rank (``group``: a world group to use instead of the
    default one)."""
    return broadcast_ints([value], 1, src=src, group=group)[0]


def broadcast_text(text: str, *, src: int = 0, group: dist.ProcessGroup | None = None) -> str:
    """``src``'s ``text`` on every rank (UTF-8 bytes in a uint8 tensor, length sent first)."""
    if world_size(group) == 1:
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


def all_gather_ints(values: list[int], group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """Every rank's list of ints, in rank order (lists may differ in length).

    ``group``: a process group over the whole world to use instead of the default one."""
    world = world_size(group)
    if world == 1:
        return [list(values)]
    dev = collective_device(group)
    length = torch.tensor([len(values)], dtype=torch.int64, device=dev)
    lengths = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.int64, device=dev)
    padded[: len(values)] = torch.tensor(values, dtype=torch.int64, device=dev)
    gathered = [torch.zeros(longest, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [g[: int(n)].tolist() for g, n in zip(gathered, lengths, strict=True)]


def differing_ranks(value: int) -> list[int]:
    """Ranks whose ``value`` differs from rank 0's (the same list on every rank)."""
    gathered = all_gather_ints([value])
    return [rank for rank, v in enumerate(gathered) if v != gathered[0]]
