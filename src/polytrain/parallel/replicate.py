"""Data parallelism for a tensor-parallel model: replicas over ``dp``, shards over ``tp``.

DDP cannot take DTensor parameters (its bucket flattening mixes DTensor and plain tensors), so a
model split by `tensor_parallel` is replicated with torch's FSDP2-based ``replicate``: the same
per-block structure as `zero` (one gradient all-reduce per block, issued as soon as backward has
produced that block's gradients, overlapping the rest of backward), with parameters kept whole
on every ``dp`` rank. The ``tp`` placements are preserved: each parameter becomes a DTensor on
the 2-D ``(dp, tp)`` mesh, ``(Replicate(), Shard(i))``, and the all-reduce runs over the ``dp``
group of each tp shard. ``replicate`` is not yet a public torch API (it comes through
`polytrain._torch_private`); the parity tests pin its behaviour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from polytrain._torch_private import replicate
from polytrain.comm.mesh import Mesh
from polytrain.models.base import BlockModel

if TYPE_CHECKING:  # [Note: lazy torch.distributed] in _lazy_dist.py
    from torch.distributed.fsdp import FSDPModule

__all__ = ["apply_replicate"]


def apply_replicate(module: BlockModel, mesh: Mesh) -> FSDPModule:
    """Replicate every block with parameters, then the root, over the ``dp`` axis."""
    dp_mesh = mesh.sub("dp")
    for block in module.blocks:
        if any(p.requires_grad for p in block.parameters()):
            replicate(block, mesh=dp_mesh)
    return replicate(module, mesh=dp_mesh)
