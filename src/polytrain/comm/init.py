"""Process-group start-up from the elastic agent's environment (or an existing group)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistContext", "available_backends", "init_distributed", "shutdown"]


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
    if not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
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
