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

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from polytrain.comm.mesh import Mesh
from polytrain.config.job import ParallelConfig
from polytrain.models.base import BlockModel

__all__ = ["apply_zero", "shard_units"]

_REDUCE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def apply_zero(module: BlockModel, mesh: Mesh, cfg: ParallelConfig) -> FSDPModule:
    """Shard every block (a user model's repeated layers, [Note: block view]), then the root."""
    return shard_units(module, module.units(), mesh.sub("dp"), cfg)


def shard_units(
    root: nn.Module, units: Iterable[nn.Module], dp_mesh: DeviceMesh, cfg: ParallelConfig
) -> FSDPModule:
    """``fully_shard`` each of ``units`` that trains over ``dp_mesh``, then ``root`` (which
    holds them): the stage mapping above. A pipeline stage is such a root
    (`pipeline.sharded`)."""
    reshard = cfg.zero == 3
    policy = MixedPrecisionPolicy(reduce_dtype=_REDUCE_DTYPES.get(cfg.grad_compression))
    for unit in units:
        if any(p.requires_grad for p in unit.parameters()):
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    return fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
