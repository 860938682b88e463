"""BatchNorm statistics over the global batch: synchronised batch normalisation.

Ioffe and Szegedy (2015) normalise with the statistics of the batch. Under data parallel, ZeRO
and synchronous parameter servers each replica holds a slice of the global batch, so a plain
BatchNorm would normalise with its slice's statistics: the step-1 loss already differs from the
single-process run, and the running statistics drift per replica (contract 1 broken). torch's
``nn.SyncBatchNorm`` sums the statistics over the replicas, but only on GPU/XPU: torch 2.13
raises "SyncBatchNorm expected input tensor to be on GPU" for CPU tensors. `GlobalBatchNorm`
does the same on any device with two differentiable all-reduces (count and sum, then the squared deviations)
(`comm.autograd`); its backward all-reduces the gradients of those sums, as SyncBatchNorm does.

[Note: BatchNorm parity] With equal slices the global mean and variance are exact up to
reassociation; running statistics use the global unbiased variance, as one process would. Every
replica runs the same module, so the all-reduce is matched on every rank. A pipeline with one
micro-batch per step does the same over the dp replicas of each stage (their group is the
stage's ``dp`` group, and every replica of a stage runs the same schedule), so dp x pp matches
too. Micro-batched pipelines cannot (a micro-batch's later layers run before the next
micro-batch's earlier ones): pre-flight says so (`models.checks`).

Shapes: B batch, C channels, ``*`` spatial dims.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from polytrain.comm.autograd import all_reduce_sum_grad
from polytrain.models.checks import BATCHNORMS

__all__ = ["GlobalBatchNorm", "convert_batchnorm"]


class GlobalBatchNorm(nn.Module):
    """A BatchNorm1d/2d/3d whose training statistics are the whole group's."""

    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    num_batches_tracked: torch.Tensor | None

    def __init__(self, bn: Any, group: Any) -> None:  # bn: one of models.checks.BATCHNORMS
        super().__init__()
        self.num_features, self.eps, self.momentum = bn.num_features, bn.eps, bn.momentum
        self.affine, self.track_running_stats = bn.affine, bn.track_running_stats
        self.group = group
        # The same Parameter and buffer objects: names, optimizer and state dict are unchanged.
        self.weight, self.bias = bn.weight, bn.bias
        self.register_buffer("running_mean", bn.running_mean)
        self.register_buffer("running_var", bn.running_var)
        self.register_buffer("num_batches_tracked", bn.num_batches_tracked)
        self.training = bn.training

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, C, *)
        if not self.training and self.track_running_stats:
            return nn.functional.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        xf = x.float()
        # Two passes (mean, then squared deviations) as torch's kernel: no E[x^2] - E[x]^2
        # cancellation, so the result stays within reassociation of the one-process value.
        count = torch.full((1,), x.numel() / x.size(1), dtype=torch.float32, device=x.device)
        sums = all_reduce_sum_grad(torch.cat([count, xf.sum(dims)]), self.group)
        n, mean = sums[0], sums[1:] / sums[0]
        centred = xf - mean.view(shape)
        var = all_reduce_sum_grad((centred * centred).sum(dims), self.group) / n  # biased
        y = centred * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        tracked = self.num_batches_tracked
        if self.running_mean is not None and self.running_var is not None and tracked is not None:
            with torch.no_grad():
                tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(tracked)
                unbiased = var * (n / (n - 1).clamp(min=1))
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.detach(), alpha=m)
        return y.to(x.dtype)


def _owns_entries(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


def convert_batchnorm(module: nn.Module, group: Any, *, owned_only: bool = False) -> int:
    """Replace every BatchNorm in ``module`` by a `GlobalBatchNorm` over ``group``, in place.

    Returns how many were replaced. Parameter and buffer names are unchanged. ``owned_only``
    skips BatchNorms whose entries a layer-pipeline stage does not own (`models.split.keep_owned`
    demoted them to plain attributes: they run only in the stage's discarded part).
    """
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, BATCHNORMS):
            if not owned_only or _owns_entries(child):
                setattr(module, name, GlobalBatchNorm(child, group))
                count += 1
        else:
            count += convert_batchnorm(child, group, owned_only=owned_only)
    return count
