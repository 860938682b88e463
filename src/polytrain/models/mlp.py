"""A multilayer perceptron; on token data it is Bengio et al.'s (2003) neural language model.

Shapes: B batch, T context, E embedding per token, C hidden width, V vocabulary.
On tokens: [Embed+flatten (B, T*E), (Linear, GELU) x n_layer, Linear -> (B, V)], predicting the
token after the window. On (inputs, targets) pairs: [(Linear, GELU) x n_layer, Linear].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from polytrain.data.datasets import DataSpec
from polytrain.models.base import BlockModel, LossFn

__all__ = ["SIZES", "build_mlp"]

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 128, "block_size": 16},
    "small": {"n_layer": 4, "n_embd": 512, "block_size": 32},
    "medium": {"n_layer": 4, "n_embd": 2048, "block_size": 32},
}

EMBED_DIM = 16


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # (B, T*E), a tensor of its own: FSDP2 warns on every step of a block whose output is a
        # view (an in-place op on it would skip its pre-backward hook); the copy is B*T*E floats
        return self.tok(idx).flatten(1).clone()


class Dense(nn.Module):
    """One hidden layer: Linear then GELU."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(fan_in, fan_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class Output(nn.Module):
    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(fan_in, fan_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (B, V) for the token after the window; targets (B, T) of which the last is used."""
    return F.cross_entropy(logits.float(), targets[:, -1])


def _pair_loss(classification: bool) -> LossFn:
    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if classification:
            return F.cross_entropy(output.float(), targets.long())
        return F.mse_loss(output.float().reshape(targets.shape), targets.float())

    return loss


def build_mlp(spec: DataSpec, n_layer: int, width: int, block_size: int) -> BlockModel:
    blocks: list[nn.Module] = []
    if spec.kind == "tokens":
        blocks.append(TokenEmbedding(spec.vocab_size, EMBED_DIM))
        fan_in, fan_out = block_size * EMBED_DIM, spec.vocab_size
        loss_fn: LossFn = next_token_loss
    else:
        blocks.append(nn.Flatten(1))
        fan_in, fan_out = math.prod(spec.input_shape), spec.num_outputs
        loss_fn = _pair_loss(spec.classification)
    for _ in range(n_layer):
        blocks.append(Dense(fan_in, width))
        fan_in = width
    blocks.append(Output(fan_in, fan_out))
    return BlockModel(blocks, loss_fn)
