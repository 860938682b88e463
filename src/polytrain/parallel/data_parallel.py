"""Data parallelism through DDP: bucketed ring all-reduce overlapped with backward.

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB
2020). Gradient accumulation skips the all-reduce of the inner micro-steps (``no_sync``); the
optional hooks halve the bytes on the wire by all-reducing bf16 or fp16 copies of the buckets,
or, across hosts, reduce inside each host first (parallel/hierarchical.py),
or replace each gradient matrix by a rank-1 PowerSGD approximation with error feedback (Vogels et
al., "PowerSGD", NeurIPS 2019; torch's own hook), or send top-k / 1-bit sign packets with error
feedback, all-gathered and decoded ([Note: sparse gradient hook] in `polytrain.comm.compression`).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from polytrain.comm.compression import (
    SentBytes,
    SparseHookState,
    compress_hook,
    powersgd_hook,
    sparse_hook,
)
from polytrain.comm.mesh import Mesh
from polytrain.config.job import ParallelConfig
from polytrain.parallel.hierarchical import apply_hierarchical

__all__ = ["apply_data_parallel"]


def apply_data_parallel(
    module: nn.Module, mesh: Mesh, cfg: ParallelConfig, sent: SentBytes | None = None
) -> DDP:
    """Wrap ``module`` in DDP over the mesh's ``dp`` axis; the compression hooks add the bytes
    they hand to c10d to ``sent``."""
    device = next(module.parameters()).device
    ddp = DDP(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh.group("dp"),
        bucket_cap_mb=cfg.bucket_mb,
        gradient_as_bucket_view=True,
    )
    if cfg.grad_compression == "powersgd":
        # Steps 1 and 2 all-reduce in full (torch requires start > 1 with error feedback); vectors
        # (biases) and matrices too small to gain are all-reduced as they are.
        state = powersgd.PowerSGDState(
            process_group=mesh.group("dp"), matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, powersgd_hook(sent))
    elif cfg.grad_compression in ("topk", "sign"):
        sparse = SparseHookState(mesh.group("dp"), cfg.grad_compression, cfg.grad_topk_ratio, sent)
        ddp.register_comm_hook(sparse, sparse_hook)
    elif cfg.grad_compression != "none":
        dtype = torch.bfloat16 if cfg.grad_compression == "bf16" else torch.float16
        ddp.register_comm_hook(mesh.group("dp"), compress_hook(dtype, sent))
    elif cfg.hierarchical != "off":
        done = apply_hierarchical(ddp, mesh, cfg)
        if mesh.rank == 0 and done != "flat":  # rank 0's stderr goes to the run's log
            print(f"polytrain: dp all-reduce: {done}", file=sys.stderr, flush=True)
    return ddp
