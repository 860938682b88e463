"""Numerical health of a step: is any gradient NaN or Inf?

A NaN can enter the gradient while the loss stays finite (an overflowing backward, a bad
custom autograd function), so the loss check alone misses it. The flag is this rank's; the
strategy all-reduces it together with the loss, so every rank takes the same branch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["nonfinite_flag"]


@torch.no_grad()
def nonfinite_flag(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 if any local gradient (a DTensor's local shard) holds NaN or Inf, else 0.0.

    One reduction per gradient and one sum: NaN and Inf propagate through sums, so a single
    finite-check of the total answers for every element.
    """
    sums = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        sums.append(local.float().sum())
    if not sums:
        return torch.zeros((), device=device)
    total = torch.stack(sums).sum()
    return (~torch.isfinite(total)).float().to(device)
