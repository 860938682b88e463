"""Fully sharded data parallelism (ZeRO; Rajbhandari et al., SC 2020) through FSDP2.

Stage mapping: ``zero = 3`` shards parameters, gradients and optimizer state and frees the
gathered parameters after each block's forward (``reshard_after_forward=True``). ``zero = 2``
keeps the gathered parameters from forward to backward (no second all-gather), which is ZeRO-2's
traffic with ZeRO-3's memory at rest. ``zero = 1`` (optimizer state only) has no FSDP2
counterpart and is rejected at configuration time.

``parallel.grad_compression`` (bf16, fp16) becomes FSDP2's ``reduce_dtype``: gradients are
reduce-scattered in that dtype (half the bytes, as DDP's compression hook) and the sharded
gradient is kept in the parameters' dtype for the optimizer step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from polytrain.comm.mesh import Mesh
from polytrain.config.job import ParallelConfig
from polytrain.core.fsdp import shard_units
from polytrain.models.base import BlockModel

if TYPE_CHECKING:  # [Note: lazy torch.distributed] in _lazy_dist.py
    from torch.distributed.fsdp import FSDPModule

__all__ = ["apply_zero"]


def apply_zero(module: BlockModel, mesh: Mesh, cfg: ParallelConfig) -> FSDPModule:
    """Shard every block (a user model's repeated layers, [Note: block view]), then the root
    (`core.fsdp.shard_units`)."""
    return shard_units(module, module.units(), mesh.sub("dp"), cfg)
