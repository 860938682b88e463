"""Sufficient-factor exchange ("late multiply") for wide linear layers under data parallel.

Xie, Zhang, Dai, Ho, Xing: "Distributed Machine Learning via Sufficient Factor Broadcasting"
(2015; 2018); called late multiply in Alibaba PAI. Shapes: N rows of a rank's micro-batch (B, or
B*T for token activations (B, T, n)), n in_features, m out_features, w data-parallel ranks.

A linear layer's weight gradient is ``dW = G^T X`` with ``X`` (N, n) its input and ``G`` (N, m)
the gradient at its output. Plain data parallel all-reduces dW (m*n numbers); here each rank
all-gathers the factors instead and multiplies late:

    dW = (1/w) * sum_r G_r^T X_r = (1/w) * G_all^T X_all,     db = (1/w) * sum over rows of G_all

where ``G_all`` (w*N, m) stacks every rank's ``G_r`` in rank order. The 1/w is DDP's mean: each
rank's loss is the mean over its own rows, so this is exactly the gradient DDP would produce,
and exactly the single-process gradient of the global batch up to float reassociation.

[Note: cost rule] Per rank, a ring all-reduce of the layer sends ``2 (w-1)/w * (m n + m)``
numbers, the factor all-gather ``(w-1) N (m + n)``. ``auto`` picks the gather for a layer when
it sends fewer bytes, i.e. roughly when ``N (m + n) < 2 m n / w``: wide layers, few rows, few
ranks. The rule counts bytes only: it ignores latency (one gather per layer against DDP's few
large buckets), the extra compute (``w N m n`` multiply-adds to rebuild dW instead of
``N m n``), the gathered factors' memory, and overlap; see docs/sufficient_factor.md.

Mechanics: a chosen ``nn.Linear`` runs `_LateMultiply`, whose backward returns the input
gradient only, starts the gather of ``[X | G]`` and queues one end-of-backward callback that
waits for every gather and writes dW and db into ``.grad`` (accumulating over micro-steps). Its
parameters are hidden from DDP (`polytrain._torch_private.ddp_ignore`), so every other
parameter stays on DDP's bucketed all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from polytrain._torch_private import ddp_ignore, queue_backward_callback
from polytrain.comm.mesh import Mesh
from polytrain.comm.sufficient_factor import (
    PendingGather,
    all_gather_bytes,
    all_gather_rows_async,
    ring_all_reduce_bytes,
)
from polytrain.errors import ConfigError

__all__ = [
    "LayerCost",
    "SufficientFactorPlan",
    "apply_sufficient_factor",
    "choose_layers",
    "layer_cost",
    "plain_linears",
    "probe_rows_per_sample",
]

Mode = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class LayerCost:
    """Bytes one rank sends per micro-step for one linear layer under each exchange."""

    name: str
    rows: int  # N
    in_features: int  # n
    out_features: int  # m
    allreduce_bytes: float
    factor_bytes: float

    @property
    def factors_cheaper(self) -> bool:
        return self.factor_bytes < self.allreduce_bytes


def layer_cost(
    name: str,
    rows: int,
    in_features: int,
    out_features: int,
    bias: bool,
    world: int,
    element_size: int = 4,
) -> LayerCost:
    grad_numel = out_features * in_features + (out_features if bias else 0)
    block = rows * (in_features + out_features) * element_size
    return LayerCost(
        name,
        rows,
        in_features,
        out_features,
        ring_all_reduce_bytes(grad_numel * element_size, world),
        float(all_gather_bytes(block, world)),
    )


def choose_layers(costs: Sequence[LayerCost], mode: Mode) -> list[str]:
    """Names of the layers that exchange factors: ``on`` all, ``auto`` the cheaper, ``off`` none."""
    if mode == "off":
        return []
    if mode == "on":
        if not costs:
            raise ConfigError(
                "parallel.sufficient_factor = 'on' but the model has no nn.Linear layer to "
                "exchange factors for: use 'auto' or 'off'"
            )
        return [c.name for c in costs]
    return [c.name for c in costs if c.factors_cheaper]


@dataclass
class SufficientFactorPlan:
    """What `apply_sufficient_factor` decided, for logs and benchmarks."""

    costs: list[LayerCost]
    chosen: list[str]  # layers that exchange factors
    ignored_params: list[str] = field(default_factory=list)  # their parameters, hidden from DDP
    allreduce_params: list[str] = field(default_factory=list)  # what DDP still all-reduces


class _Exchange:
    """The gathers in flight during one backward pass over the ``dp`` group."""

    def __init__(self, group: Any, world: int) -> None:
        self.group, self.world = group, world
        self.pending: list[tuple[nn.Linear, PendingGather]] = []
        self.queued = False

    def start(self, layer: nn.Linear, x: torch.Tensor, g: torch.Tensor) -> None:
        rows = torch.cat([x.to(g.dtype), g], dim=1)  # (N, n + m)
        self.pending.append((layer, all_gather_rows_async(rows, self.group)))
        if not self.queued:
            self.queued = True
            queue_backward_callback(self.finish)

    @torch.no_grad()
    def finish(self) -> None:
        for layer, pending in self.pending:
            rows = pending.wait()
            n = layer.in_features
            x_all, g_all = rows[:, :n].float(), rows[:, n:].float()  # (w*N, n), (w*N, m)
            _accumulate(layer.weight, (g_all.T @ x_all).div_(self.world))
            if layer.bias is not None:
                _accumulate(layer.bias, g_all.sum(0).div_(self.world))
        self.pending.clear()
        self.queued = False


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _LateMultiply(torch.autograd.Function):
    """``y = x W^T + b``; backward returns dx only and hands (X, G) to the exchange."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: nn.Linear,
        exchange: _Exchange,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.exchange = layer, exchange
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (g,) = grads  # (..., m)
        x, weight = ctx.saved_tensors  # (..., n), (m, n)
        ctx.exchange.start(ctx.layer, x.reshape(-1, x.size(-1)), g.reshape(-1, g.size(-1)))
        grad_x = (g @ weight.to(g.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None


class _SufficientFactorLinear(nn.Linear):
    """An ``nn.Linear`` whose weight gradient arrives by factor exchange (same parameters)."""

    _sf_exchange: _Exchange

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.linear(input, self.weight, self.bias)
        out: torch.Tensor = _LateMultiply.apply(
            input, self.weight, self.bias, self, self._sf_exchange
        )
        return out


def plain_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Linear layers whose forward is nn.Linear's own (a subclass may compute otherwise)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
    }


@torch.no_grad()
def probe_rows_per_sample(model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
    """Rows each plain Linear sees per input sample (1, or T for (B, T, n) activations)."""
    rows: dict[str, int] = {}
    handles = []
    for name, layer in plain_linears(model).items():

        def hook(_: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
            rows[name] = args[0].numel() // args[0].size(-1)

        handles.append(layer.register_forward_pre_hook(hook))
    was_training = model.training
    try:
        model.eval()
        with torch.random.fork_rng(devices=[]):
            model(sample[:1])
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return rows


def apply_sufficient_factor(
    model: nn.Module, mesh: Mesh, mode: Mode, sample: torch.Tensor, local_batch: int
) -> SufficientFactorPlan:
    """Move the chosen Linear layers of ``model`` to factor exchange over the ``dp`` axis.

    ``sample`` is one input batch (only its first sample is run, to learn each layer's rows per
    sample); ``local_batch`` is the samples one rank runs per micro-step. Call before DDP: the
    chosen layers' parameters are marked for DDP to ignore.
    """
    world = mesh.dims.dp
    linears = plain_linears(model)
    per_sample = probe_rows_per_sample(model, sample)
    costs = [
        layer_cost(
            name,
            per_sample[name] * local_batch,
            layer.in_features,
            layer.out_features,
            layer.bias is not None,
            world,
            layer.weight.element_size(),
        )
        for name, layer in linears.items()
        if name in per_sample
    ]
    chosen = choose_layers(costs, mode) if world > 1 else []
    exchange = _Exchange(mesh.group("dp"), world)
    ignored: list[str] = []
    for name in chosen:
        layer = linears[name]
        layer.__class__ = _SufficientFactorLinear
        object.__setattr__(layer, "_sf_exchange", exchange)  # not a submodule nor a buffer
        ignored += [f"{name}.{p}" for p, _ in layer.named_parameters()]
    ddp_ignore(model, ignored)
    remaining = [
        n for n, p in model.named_parameters() if p.requires_grad and n not in set(ignored)
    ]
    return SufficientFactorPlan(costs, chosen, ignored, remaining)
