"""Small user models for the model-contract tests (plain torch; factories take ``(spec, **args)``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class DictOut(nn.Module):
    """Returns a dict; ``key`` names the predictions ('logits' fits the contract, 'hidden' not)."""

    def __init__(self, fan_in: int, fan_out: int, key: str) -> None:
        super().__init__()
        self.fc = nn.Linear(fan_in, fan_out)
        self.key = key

    def forward(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.key: self.fc(inputs)}


def dict_logits(spec: Any, width: int = 4) -> nn.Module:
    return DictOut(spec.input_shape[0], spec.num_outputs, "logits")


def dict_hidden(spec: Any) -> nn.Module:
    return DictOut(spec.input_shape[0], spec.num_outputs, "hidden")


def linear(spec: Any, **args: Any) -> nn.Module:
    """A linear model; records its keyword arguments on the module (for the ``model.args`` test)."""
    model = nn.Linear(spec.input_shape[0], spec.num_outputs, bias=args.get("bias", True))
    model.factory_args = dict(args)  # type: ignore[assignment]
    return model


def reads_values(spec: Any) -> nn.Module:
    """A constructor that reads a tensor value: fails on the meta device."""
    scale = torch.ones(1).sum().item()
    return nn.Linear(spec.input_shape[0], int(scale) * spec.num_outputs)


def per_row_loss(predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Not reduced: one value per row (the contract wants a scalar)."""
    return (predictions - predictions.detach()).sum(-1)


def tied_sequential(spec: Any) -> nn.Module:
    """An embedding and an output layer sharing one weight (GPT-2 style), as a Sequential."""
    emb = nn.Embedding(spec.vocab_size, 8)
    head = nn.Linear(8, spec.vocab_size, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Linear(8, 8), head)


def batchnorm_mlp(spec: Any) -> nn.Module:
    width = spec.input_shape[0]
    return nn.Sequential(
        nn.Linear(width, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, spec.num_outputs)
    )


def inplace_relus(spec: Any) -> nn.Module:
    """ReLU(inplace=True) first in a stage under partition [2, 4]: it would modify the received
    activation, a leaf that requires grad (issue 12)."""
    width = spec.input_shape[0]
    return nn.Sequential(
        nn.Linear(width, 16),
        nn.Linear(16, 16),
        nn.ReLU(inplace=True),
        nn.Linear(16, 16),
        nn.ReLU(inplace=True),
        nn.Linear(16, spec.num_outputs),
    )


def rgb_cnn(spec: Any) -> nn.Module:
    """A CNN for 3-channel images, whatever the data holds (the channel check's subject)."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, spec.num_outputs),
    )
