"""`pipeline.backward_split`: I then W give a full backward's gradients, and W does not walk the
activation-gradient path again ([Note: weight gradients from the consumers])."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from polytrain.pipeline.backward_split import backward_input, backward_weight


class Chain(nn.Module):
    """Linear, tanh, Linear with a bias added by hand and a parameter off the input's path."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.shift = nn.Parameter(torch.randn(6))
        self.table = nn.Embedding(4, 6)  # looked up at fixed positions: no input on its path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) + self.shift + self.table(torch.arange(x.shape[1]) % 4)


class Shared(nn.Module):
    """One weight used twice on the input's path: its later use reaches its earlier one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def _encoder() -> nn.Module:
    # Attention uses its in_proj_weight functionally (F.multi_head_attention_forward).
    return nn.TransformerEncoderLayer(6, 2, dim_feedforward=12, dropout=0.0, batch_first=True)


def _checkpointed() -> nn.Module:
    inner = Chain()

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = checkpoint(self.inner, x, use_reentrant=False)
            assert isinstance(out, torch.Tensor)
            return out

    return Wrapped()


MODULES: dict[str, Callable[[], nn.Module]] = {
    "chain": Chain,
    "shared weight": Shared,
    "transformer layer": _encoder,
    "checkpointed": _checkpointed,
}


def _full(
    module: nn.Module, x: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """A plain backward: the input's gradient and every parameter's."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    module(x).backward(g)
    grads = [p.grad for p in module.parameters()]
    assert all(g is not None for g in grads)
    return x.grad, [g.clone() for g in grads if g is not None]


@pytest.mark.parametrize("name", list(MODULES))
def test_i_then_w_equals_backward(name: str) -> None:
    torch.manual_seed(0)
    module = MODULES[name]()
    xs = [torch.randn(3, 4, 6) for _ in range(2)]
    gs = [torch.randn(3, 4, 6) for _ in range(2)]
    expected_x, expected = _full(module, xs[0], gs[0])
    module.zero_grad(set_to_none=True)
    x = xs[0].clone().requires_grad_()
    params = list(module.parameters())
    input_grad, pending = backward_input(module(x), gs[0], x, params)
    assert all(p.grad is None for p in params)  # I leaves the weights alone
    assert x.grad is None and input_grad is not None
    torch.testing.assert_close(input_grad, expected_x, rtol=0, atol=1e-6)
    backward_weight(pending)
    for (n, p), e in zip(module.named_parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=1e-6, msg=n)
    # A second micro-batch accumulates like backward does.
    _, expected_second = _full(module, xs[1], gs[1])
    module.zero_grad(set_to_none=True)
    for x0, g in zip(xs, gs, strict=True):
        x = x0.clone().requires_grad_()
        backward_weight(backward_input(module(x), g, x, params)[1])
    for (n, p), e0, e1 in zip(module.named_parameters(), expected, expected_second, strict=True):
        torch.testing.assert_close(p.grad, e0 + e1, rtol=0, atol=1e-5, msg=n)


def test_w_does_not_walk_the_activation_path_again() -> None:
    """The gradient of the hidden activation between the layers is computed once, in I."""
    torch.manual_seed(0)
    a, b = nn.Linear(6, 6), nn.Linear(6, 6)
    x = torch.randn(3, 6, requires_grad=True)
    hidden = torch.tanh(a(x))
    seen: list[int] = []
    hidden.register_hook(lambda g: seen.append(1))
    params = [*a.parameters(), *b.parameters()]
    _, pending = backward_input(b(hidden), torch.ones(3, 6), x, params)
    assert len(seen) == 1
    backward_weight(pending)
    assert len(seen) == 1
    assert all(p.grad is not None for p in [*a.parameters(), *b.parameters()])


def test_input_without_gradient_leaves_everything_to_w() -> None:
    """The first stage's input (token ids, or data) needs no gradient: I does nothing, W is
    the whole backward."""
    torch.manual_seed(0)
    module = Chain()
    x, g = torch.randn(3, 4, 6), torch.randn(3, 4, 6)
    _, expected = _full(module, x, g)
    module.zero_grad(set_to_none=True)
    input_grad, pending = backward_input(module(x), g, x, list(module.parameters()))
    assert input_grad is None and all(p.grad is None for p in module.parameters())
    backward_weight(pending)
    for p, e in zip(module.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)
