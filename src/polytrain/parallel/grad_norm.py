"""Gradient-norm clipping over a mix of DTensor (tensor-parallel, FSDP2) and plain gradients."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


def _params_by_mesh(params: Iterable[torch.Tensor]) -> Mapping[object, list[torch.Tensor]]:
    """Parameters with a gradient, grouped by their gradient's mesh (None: plain tensors)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    return groups


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a mix of DTensor and plain gradients.

    torch's version runs one foreach kernel over all gradients, which refuses DTensors on
    different meshes or mixed with plain tensors. Here each group (plain, or one DTensor mesh)
    gets its norm separately; a DTensor norm is reduced over its mesh (sharded parts summed,
    replicated ones counted once), and the coefficient is applied group by group.
    """
    groups = _params_by_mesh(params)
    norms: list[torch.Tensor] = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
