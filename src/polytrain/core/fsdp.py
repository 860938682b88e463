"""FSDP2's ``fully_shard`` over a data-parallel mesh, one unit at a time, then the root: ZeRO
as the SPMD family applies it (`parallel.zero`, whose docstring gives the stage mapping) and as
the pipeline's sharded stages do (`pipeline.sharded`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from polytrain.config.job import ParallelConfig

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["shard_units"]

_REDUCE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shard_units(
    root: nn.Module, units: Iterable[nn.Module], dp_mesh: DeviceMesh, cfg: ParallelConfig
) -> FSDPModule:
    """``fully_shard`` each of ``units`` that trains over ``dp_mesh``, then ``root`` (which
    holds them)."""
    # Imported here, not at the top: [Note: lazy torch.distributed] in _lazy_dist.py.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard = cfg.zero == 3
    policy = MixedPrecisionPolicy(reduce_dtype=_REDUCE_DTYPES.get(cfg.grad_compression))
    for unit in units:
        if any(p.requires_grad for p in unit.parameters()):
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    return fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
