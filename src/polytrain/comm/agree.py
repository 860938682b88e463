"""Tensor-only agreement between ranks: gather small integer lists, find the ranks that differ.

The c10d object collectives (``all_gather_object``, ``broadcast_object_list``) pickle their
payload over the network; these helpers move int64 tensors only, so a peer can send nothing but
numbers.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from polytrain.comm.collectives import collective_device, world_size

__all__ = ["all_gather_ints", "broadcast_int", "differing_ranks", "fingerprint"]


def fingerprint(text: str) -> int:
    """A signed 63-bit digest of ``text`` (sha256), small enough for an int64 tensor."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def all_gather_ints(values: list[int], group: Any = None) -> list[list[int]]:
    """Every rank's list of ints, in rank order (lists may differ in length).

    ``group``: a process group over the whole world to use instead of the default one."""
    if world_size(group) == 1:
        return [list(values)]
    world, dev = world_size(group), collective_device(group)
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


def broadcast_int(value: int, src: int = 0, group: Any = None) -> int:
    """Rank ``src``'s ``value`` on every rank (``group``: as in `all_gather_ints`)."""
    if world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.broadcast(t, src=src, group=group)
    return int(t.item())
