"""`GlobalBatchNorm` in one process is torch's BatchNorm: output, gradients, running statistics,
and the activation memory it saves for backward ([Note: BatchNorm saves its input only]).

The cross-replica statistics are checked against one process in tests/distributed/test_cnn.py
(dp 2 and 4, spatial bands) and tests/ecosystem (users' BatchNorm models).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from polytrain.core.batchnorm import GlobalBatchNorm
from polytrain.pipeline.saved_tensors import count_saved_bytes


@pytest.mark.parametrize(
    ("bn", "shape"),
    [
        (nn.BatchNorm2d(6), (4, 6, 5, 7)),
        (nn.BatchNorm1d(6), (16, 6)),
        (nn.BatchNorm1d(6, affine=False), (4, 6, 9)),
        (nn.BatchNorm3d(3, momentum=None), (2, 3, 4, 4, 4)),
    ],
)
def test_one_process_matches_torch_batchnorm(bn: nn.Module, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    if getattr(bn, "affine", False):
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    ours = GlobalBatchNorm(copy.deepcopy(bn), group=None)
    for step in range(2):  # twice: the running statistics' update is compared as well
        x = torch.randn(shape, dtype=torch.float64).float() * 3 + step
        dy = torch.randn(shape)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = bn(x1), ours(x2)
        y1.backward(dy)
        y2.backward(dy)
        torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-4, atol=1e-5)
    for a, b in zip(ours.parameters(), bn.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.running_mean, bn.running_mean)
    torch.testing.assert_close(ours.running_var, bn.running_var)
    ours.eval(), bn.eval()
    x = torch.randn(shape)
    torch.testing.assert_close(ours(x), bn(x))


def test_saves_for_backward_what_torch_batchnorm_saves() -> None:
    """The input and C-vectors only: a chain of differentiable ops saved ~3x the input."""
    x = torch.randn(8, 16, 12, 12, requires_grad=True)
    bn = nn.BatchNorm2d(16)
    ours = GlobalBatchNorm(copy.deepcopy(bn), group=None)
    with count_saved_bytes(set()) as torch_saved:
        bn(x)
    with count_saved_bytes(set()) as our_saved:
        ours(x)
    input_bytes = x.numel() * x.element_size()
    assert torch_saved.bytes >= input_bytes
    assert our_saved.bytes <= torch_saved.bytes + 1024  # a few C-vectors more at most
