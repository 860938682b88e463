"""The global gradient norm over a mix of DTensor (tensor-parallel, FSDP2) and plain gradients."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from polytrain._lazy_dist import is_dtensor

__all__ = ["grad_norm"]


def _grads_by_mesh(grads: Sequence[torch.Tensor]) -> Mapping[object, list[torch.Tensor]]:
    """Gradients grouped by their mesh (None: plain tensors)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = g.device_mesh if is_dtensor(g) else None
        groups.setdefault(key, []).append(g)
    return groups


@torch.no_grad()
def grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The norm of all of ``grads`` together, as ``torch.nn.utils.get_total_norm`` would give.

    torch's version runs one foreach kernel over all gradients, which refuses DTensors on
    different meshes or mixed with plain tensors. Here each group (plain, or one DTensor mesh)
    gets its norm separately; a DTensor norm is reduced over its mesh (sharded parts summed,
    replicated ones counted once). `polytrain.core.clip_gradients_` applies the coefficient.
    """
    norms: list[torch.Tensor] = []
    for group in _grads_by_mesh(grads).values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if is_dtensor(norm) else norm)
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
