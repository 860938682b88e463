"""Bytes a process holds right now, for tests that prove a memory feature (STYLE 19).

`heap_bytes_in_use` reads glibc's ``mallinfo2``: bytes in allocated heap chunks plus mmapped
blocks, over every arena. On CPU, torch's allocator is plain ``malloc`` (no caching), so the
difference between two readings is the tensors allocated and still alive in between, which is
what recomputation or sharding should shrink. `resident_parameter_bytes` counts the storages
that a module's parameters hold now (a sharded DTensor's local shard; 0 for a storage FSDP has
freed), each storage once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Iterable
from functools import cache

import torch

from polytrain._lazy_dist import local_tensor

__all__ = ["heap_bytes_in_use", "resident_parameter_bytes"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@cache
def _mallinfo2() -> Callable[[], _MallInfo2]:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    try:
        fn = libc.mallinfo2
    except AttributeError as exc:
        raise RuntimeError("heap_bytes_in_use needs glibc >= 2.33 (mallinfo2)") from exc
    fn.restype = _MallInfo2
    return fn


def heap_bytes_in_use() -> int:
    """Bytes this process has allocated with ``malloc`` and not freed (glibc only)."""
    info = _mallinfo2()()
    return int(info.uordblks + info.hblkhd)


def resident_parameter_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages that ``params`` hold now (DTensors: the local shard)."""
    seen: dict[int, int] = {}
    for p in params:
        local = local_tensor(p)
        storage = local.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
