"""Process-group start-up from the elastic agent's environment (or an existing group).

[Note: group timeouts] ``launch.timeout_s`` is the default group's timeout, but torch gives
every group made later (``dist.new_group``, a ``DeviceMesh``'s dimensions) its own 30-minute
default. A collective on such a group with a host cut off then hangs for half an hour instead
of failing within the job's timeout: measured on the emulated two-host cluster, the leaders'
all-reduce of the hierarchical DDP hook was still waiting 90 s after the cut. So polytrain makes
every group through `new_group` here (and `comm.mesh` passes `mesh_timeout_options`), which
carry the timeout `init_distributed` was given.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from polytrain._torch_private import gloo_options

__all__ = [
    "DistContext",
    "available_backends",
    "group_timeout",
    "init_distributed",
    "mesh_timeout_options",
    "new_group",
    "resolve_backend",
    "shutdown",
]

_timeout: list[datetime.timedelta] = []  # the job's collective timeout, once init_distributed ran


@dataclass(frozen=True)
class DistContext:
    """Who this process is and where it computes."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_backend(backend: str, device_type: str) -> str:
    """``launch.backend``: "auto" is nccl on cuda, gloo on cpu."""
    if backend != "auto":
        return backend
    return "nccl" if device_type == "cuda" else "gloo"


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank % max(torch.cuda.device_count(), 1))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(
    *, device: str = "cpu", backend: str = "auto", timeout_s: float = 300.0
) -> DistContext:
    """Join the process group described by ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``.

    If a group already exists (the test harness made one), it is reused. A single process
    with no launcher environment gets a one-rank gloo group on a private file store, so every
    code path runs through the same collectives.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    _timeout[:] = [timeout]
    if not dist.is_initialized():
        backend = resolve_backend(backend, dev.type)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(
                backend=backend, timeout=timeout, device_id=dev if dev.type == "cuda" else None
            )
        else:
            store = dist.HashStore()
            dist.init_process_group(
                backend=backend, store=store, rank=0, world_size=1, timeout=timeout
            )
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=dev,
        backend=str(dist.get_backend()),
    )


def group_timeout() -> datetime.timedelta | None:
    """The job's collective timeout (None before `init_distributed`: torch's default)."""
    return _timeout[0] if _timeout else None


def new_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` with the job's timeout ([Note: group timeouts]).

    Collective over the default group: every rank must call it, with the same ranks, in the
    same order."""
    group = dist.new_group(list(ranks), timeout=group_timeout())
    assert group is not None  # every rank of the world calls it: none gets NON_GROUP_MEMBER
    return group


def mesh_timeout_options(
    dim_names: Sequence[str],
) -> dict[int | str, Any] | None:
    """``init_device_mesh``'s ``backend_override`` that gives each named dimension's groups the
    job's timeout (gloo only; None where torch's defaults stand)."""
    timeout = group_timeout()
    if timeout is None or dist.get_backend() != "gloo":
        return None
    return {name: ("gloo", gloo_options(timeout)) for name in dim_names}


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def available_backends() -> list[str]:
    """The c10d backends this torch build offers."""
    found = [
        ("gloo", dist.is_gloo_available()),
        ("nccl", dist.is_nccl_available()),
        ("mpi", dist.is_mpi_available()),
    ]
    return [name for name, ok in found if ok]
