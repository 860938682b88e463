"""User model factories that record memory at chosen points of the forward, for feature tests.

A probe is a parameter-free identity block (so recomputation and sharding leave it unwrapped).
In a training-mode forward it appends ``(kind, bytes)`` to `READINGS` in its own process: the
rank function that ran `train` returns the list. ``kind`` is ``"start"`` for a probe that opens
a stage (or the model), ``"end"`` for one that closes it.

- ``activations``: heap bytes in use (`polytrain.testing.memory.heap_bytes_in_use`).
- ``residency``: bytes the MLP blocks' parameters hold (`resident_parameter_bytes`).
"""

from __future__ import annotations

import torch
from torch import nn

from polytrain.data import DataSpec
from polytrain.models.base import BlockModel
from polytrain.testing.memory import heap_bytes_in_use, resident_parameter_bytes

WIDTH = 128  # MLP width; the hidden layer is 4x wider
BLOCK_SIZE = 64  # pass model.block_size = 64 with these factories
READINGS: list[tuple[str, int]] = []


class _Probe(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.watched: list[nn.Module] = []  # residency probes: the blocks to read (a plain list,
        # so they are not registered twice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            value = (
                resident_parameter_bytes(p for m in self.watched for p in m.parameters())
                if self.watched
                else heap_bytes_in_use()
            )
            READINGS.append((self.kind, value))
        return x


def _mlp() -> nn.Module:
    """Saves ~9 floats per token and width unit for backward (input, GELU's input and output)."""
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))


def _embed(spec: DataSpec) -> nn.Module:
    return nn.Embedding(spec.vocab_size, WIDTH)


def activations(spec: DataSpec) -> nn.Module:
    """start, embed, 4 MLPs, end, head: the probes bracket the whole forward."""
    blocks = [_Probe("start"), _embed(spec), *(_mlp() for _ in range(4)), _Probe("end")]
    return BlockModel([*blocks, nn.Linear(WIDTH, spec.vocab_size)])


def activations_two_stages(spec: DataSpec) -> nn.Module:
    """Two stages of 5 blocks (``pipeline.partition = [5, 5]``), each bracketed by probes:
    [start, embed, MLP, MLP, end] and [start, MLP, MLP, end, head]."""
    first = [_Probe("start"), _embed(spec), _mlp(), _mlp(), _Probe("end")]
    second = [_Probe("start"), _mlp(), _mlp(), _Probe("end"), nn.Linear(WIDTH, spec.vocab_size)]
    return BlockModel([*first, *second])


def residency(spec: DataSpec) -> nn.Module:
    """start, embed, 4 MLPs, end, head; the probes read what the 4 MLPs' parameters hold."""
    mlps = [_mlp() for _ in range(4)]
    start, end = _Probe("start"), _Probe("end")
    start.watched = end.watched = mlps
    return BlockModel([start, _embed(spec), *mlps, end, nn.Linear(WIDTH, spec.vocab_size)])


def residency_two_stages(spec: DataSpec) -> nn.Module:
    """Two stages of 5 blocks (``pipeline.partition = [5, 5]``), each bracketed by probes that
    read what the stage's 2 MLPs' parameters hold: [start, embed, MLP, MLP, end] and
    [start, MLP, MLP, end, head]."""
    first, second = [_mlp(), _mlp()], [_mlp(), _mlp()]
    probes = [_Probe("start"), _Probe("end"), _Probe("start"), _Probe("end")]
    for probe, watched in zip(probes, [first, first, second, second], strict=True):
        probe.watched = watched
    head = nn.Linear(WIDTH, spec.vocab_size)
    return BlockModel(
        [probes[0], _embed(spec), *first, probes[1], probes[2], *second, probes[3], head]
    )


def mlp_param_bytes() -> int:
    """Bytes of the 4 MLP blocks' parameters, whole."""
    per_block = 2 * WIDTH * 4 * WIDTH + 4 * WIDTH + WIDTH
    return 4 * 4 * per_block


def saved_bytes_per_mlp(tokens: int) -> int:
    """Bytes one MLP block saves for backward on ``tokens`` rows without recomputation: its input
    (WIDTH), GELU's input (4 WIDTH) and the second Linear's input (4 WIDTH), fp32."""
    return 4 * tokens * 9 * WIDTH
