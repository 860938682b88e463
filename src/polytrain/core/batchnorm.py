"""BatchNorm statistics over the global batch: synchronised batch normalisation.

Ioffe and Szegedy (2015) normalise with the statistics of the batch. Under data parallel, ZeRO
and synchronous parameter servers each replica holds a slice of the global batch, so a plain
BatchNorm would normalise with its slice's statistics: the step-1 loss already differs from the
single-process run, and the running statistics drift per replica (contract 1 broken). torch's
``nn.SyncBatchNorm`` sums the statistics over the replicas, but only on GPU/XPU: torch 2.13
raises "SyncBatchNorm expected input tensor to be on GPU" for CPU tensors. `GlobalBatchNorm`
does the same on any device: the forward all-reduces the count and sum, then the squared
deviations; the backward all-reduces the two per-channel sums the input's gradient needs, as
SyncBatchNorm does.

[Note: BatchNorm saves its input only] The statistics and the backward are one autograd
Function (`_GlobalBatchNormFn`), not a chain of differentiable ops: autograd would save the
centred input, the normalised output and their products (about 2x the input) where torch's
BatchNorm saves the input and two C-vectors. The backward is the batch-norm gradient with global
means (Ioffe and Szegedy 2015, sec. 3): with ``xhat = (x - mean) * invstd``,
``dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat))``, the means over the group's
whole batch (one all-reduce of the two sums); ``dw = sum(dy * xhat)`` and ``db = sum(dy)`` over
the local slice, as for any parameter whose replicas' gradients the strategy then reduces.

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

from polytrain.comm.collectives import all_reduce_sum_
from polytrain.models.checks import BATCHNORMS

__all__ = ["GlobalBatchNorm", "convert_batchnorm"]


def _layout(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """Reduction dims (all but channels) and the shape that broadcasts a C-vector over x."""
    return [0, *range(2, x.dim())], [1, -1] + [1] * (x.dim() - 2)


class _GlobalBatchNormFn(torch.autograd.Function):
    """Batch normalisation with the group's statistics; [Note: BatchNorm saves its input only].

    Returns ``(y, mean, biased var, count)``; only ``y`` is differentiable.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        group: Any,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        dims, shape = _layout(x)
        xf = x.float()
        # Two passes (mean, then squared deviations) as torch's kernel: no E[x^2] - E[x]^2
        # cancellation, so the result stays within reassociation of the one-process value.
        count = torch.full((1,), x.numel() / x.size(1), dtype=torch.float32, device=x.device)
        sums = all_reduce_sum_(torch.cat([count, xf.sum(dims)]), group)
        n, mean = sums[0], sums[1:] / sums[0]
        y = xf - mean.view(shape)
        var = all_reduce_sum_((y * y).sum(dims), group) / n
        invstd = torch.rsqrt(var + eps)
        y.mul_(invstd.view(shape))
        if weight is not None and bias is not None:
            y = torch.addcmul(bias.float().view(shape), y, weight.float().view(shape))
        ctx.save_for_backward(x, weight, mean, invstd, n)
        ctx.group = group
        ctx.mark_non_differentiable(mean, var, n)
        return y.to(x.dtype), mean, var, n

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor, *_stats: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight, mean, invstd, n = ctx.saved_tensors
        dims, shape = _layout(x)
        dyf = dy.float()
        xhat = (x.float() - mean.view(shape)).mul_(invstd.view(shape))
        sum_dy, sum_dy_xhat = dyf.sum(dims), (dyf * xhat).sum(dims)
        dweight = dbias = None
        if weight is not None:
            dweight, dbias = sum_dy_xhat.to(weight.dtype), sum_dy.to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            means = all_reduce_sum_(torch.cat([sum_dy, sum_dy_xhat]), ctx.group) / n
            mean_dy, mean_dy_xhat = means.chunk(2)
            scale = invstd if weight is None else invstd * weight.float()
            xhat.mul_(mean_dy_xhat.view(shape)).neg_().add_(dyf).sub_(mean_dy.view(shape))
            dx = xhat.mul_(scale.view(shape)).to(x.dtype)
        return dx, dweight, dbias, None, None


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
        weight, bias = (self.weight, self.bias) if self.affine else (None, None)
        y, mean, var, n = _GlobalBatchNormFn.apply(x, weight, bias, self.group, self.eps)
        tracked = self.num_batches_tracked
        if self.running_mean is not None and self.running_var is not None and tracked is not None:
            with torch.no_grad():
                tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(tracked)
                unbiased = var * (n / (n - 1).clamp(min=1))
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.detach(), alpha=m)
        return y


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
