"""Recomputation: same names, same gradients, fewer saved activations, and each policy
(whole blocks, every K-th, selective per op) recomputes what it says (core/recompute.py)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

from polytrain._torch_private import TorchDispatchMode
from polytrain.config.parallel import RecomputePolicy, recompute_policy
from polytrain.core.recompute import apply_recompute, is_recomputed
from polytrain.errors import ConfigError
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


def _ops_in_backward(model: BlockModel, x: torch.Tensor) -> Counter[str]:
    """The aten ops run during backward: a recomputed forward shows up as forward ops there."""

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    loss = model.loss(model(x), x)
    with Count() as counter:
        loss.backward()
    return counter.ops


@pytest.mark.parametrize(
    ("policy", "blocks", "matmuls", "gelus"),
    [
        (RecomputePolicy("none"), [], 0, 0),
        # torch stops a recomputation once backward's tensors are rebuilt: each block's first
        # Linear (addmm) and its GELU run again, its last Linear does not
        (RecomputePolicy("full"), [0, 1, 2], 3, 3),
        (RecomputePolicy("full", every=2), [0, 2], 2, 2),
        (RecomputePolicy("ops"), [0, 1, 2], 0, 3),  # matmul outputs kept, GELU recomputed
    ],
    ids=["none", "full", "every2", "ops"],
)
def test_each_policy_recomputes_what_it_says(
    policy: RecomputePolicy, blocks: list[int], matmuls: int, gelus: int
) -> None:
    plain = _model()
    model = apply_recompute(copy.deepcopy(plain), policy)
    assert [k for k, b in enumerate(list(model.blocks)[:3]) if is_recomputed(b)] == blocks
    x = torch.randn(8, 32)
    torch.manual_seed(1)
    ops = _ops_in_backward(model, x)
    assert ops["addmm"] == matmuls  # forward's Linear; backward's own matmuls are mm
    assert ops["gelu"] == gelus  # forward's GELU; backward's own is gelu_backward
    torch.manual_seed(1)
    plain.loss(plain(x), x).backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, RecomputePolicy("full")),
        ("full", RecomputePolicy("full")),
        ("every:3", RecomputePolicy("full", every=3)),
        ("ops", RecomputePolicy("ops")),
        (False, RecomputePolicy("none")),
    ],
)
def test_recompute_values_name_a_policy(value: bool | str, expected: RecomputePolicy) -> None:
    assert recompute_policy(value) == expected


@pytest.mark.parametrize("value", ["every:0", "every:x", "sometimes"])
def test_a_bad_recompute_value_is_one_line(value: str) -> None:
    with pytest.raises(ConfigError, match=r"parallel.recompute = .*: expected true, false"):
        recompute_policy(value)
