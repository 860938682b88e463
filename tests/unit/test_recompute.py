"""SPMD recomputation: same names, same gradients, fewer saved activations (parallel/recompute)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from polytrain.core.recompute import apply_recompute, is_recomputed
from polytrain.models.base import BlockModel


def _model() -> BlockModel:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Dropout(0.2), nn.Linear(256, 32))
        for _ in range(3)
    ]
    return BlockModel([*blocks, nn.Identity()], loss_fn=lambda out, y: (out - y).pow(2).mean())


def _saved_bytes(model: BlockModel, x: torch.Tensor) -> int:
    total = 0
    torch.manual_seed(1)  # the same dropout masks for both models; recomputation replays them

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(model(x), x).backward()
    return total


def test_recompute_keeps_names_and_gradients_and_saves_fewer_activations() -> None:
    plain = _model()
    recomputed = apply_recompute(copy.deepcopy(plain))
    assert [n for n, _ in recomputed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert all(is_recomputed(b) for b in list(recomputed.blocks)[:3])
    assert not is_recomputed(recomputed.blocks[3])  # no parameters: nothing to recompute
    x = torch.randn(64, 32)
    plain_bytes = _saved_bytes(plain, x)
    recomputed_bytes = _saved_bytes(recomputed, x)
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    # Each block keeps its (64, 32) input instead of its (64, 256) hidden activations.
    assert recomputed_bytes < plain_bytes / 2


def test_a_deep_copy_recomputes_its_own_block() -> None:
    model = apply_recompute(_model())
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    x = torch.randn(4, 32)
    assert torch.count_nonzero(clone(x)) == 0  # the copy's forward runs the copy's weights
    assert torch.count_nonzero(model(x)) > 0
