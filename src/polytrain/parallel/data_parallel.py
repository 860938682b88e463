"""Data parallelism through DDP: bucketed ring all-reduce overlapped with backward.

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB
2020). Gradient accumulation skips the all-reduce of the inner micro-steps (``no_sync``); the
optional hooks halve the bytes on the wire by all-reducing bf16 or fp16 copies of the buckets,
or, across hosts, reduce inside each host first (parallel/hierarchical.py).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from polytrain.comm.compression import compress_hook
from polytrain.comm.mesh import Mesh
from polytrain.config.job import ParallelConfig
from polytrain.parallel.hierarchical import apply_hierarchical

__all__ = ["apply_data_parallel"]


def apply_data_parallel(module: nn.Module, mesh: Mesh, cfg: ParallelConfig) -> DDP:
    """Wrap ``module`` in DDP over the mesh's ``dp`` axis."""
    device = next(module.parameters()).device
    ddp = DDP(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh.group("dp"),
        bucket_cap_mb=cfg.bucket_mb,
        gradient_as_bucket_view=True,
    )
    if cfg.grad_compression != "none":
        dtype = torch.bfloat16 if cfg.grad_compression == "bf16" else torch.float16
        ddp.register_comm_hook(mesh.group("dp"), compress_hook(dtype))
    elif cfg.hierarchical != "off":
        done = apply_hierarchical(ddp, mesh, cfg)
        if mesh.rank == 0 and done != "flat":  # rank 0's stderr goes to the run's log
            print(f"polytrain: dp all-reduce: {done}", file=sys.stderr, flush=True)
    return ddp
