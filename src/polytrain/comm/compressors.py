"""Message compressors with error feedback: top-k and 1-bit sign (pure tensor math, no c10d).

1-bit SGD (Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014, CNTK) sends the sign of
each value times one magnitude per tensor and carries the quantization error into the next
message; top-k (Stich et al., "Sparsified SGD with Memory", NeurIPS 2018) sends the ``k``
largest values and their indices and carries the rest.

[Note: error feedback] `ErrorFeedback.compress(x)` compresses ``c = x + e`` and keeps
``e = c - decode(C(c))``. Summed over messages, ``sum(sent) = sum(x) - e_T``: whatever a
message leaves out is sent later, so the running sum of what was sent follows the running sum
of the inputs up to one residual, which stays bounded (the compressors here are contractions:
``||c - decode(C(c))|| < ||c||``), instead of drifting away as the sum of independent errors
would.

A `Packet` is the list of tensors a compressed vector is made of; on the wire it travels as
one uint8 tensor (`Packet.to_bytes`) whose length is fixed by the vector's length, so the
receiver allocates it without a header. Its ``nbytes`` is what is handed to c10d. Shapes: every vector
here is flat, ``(n,)``; ``segments`` are the lengths of the parameter tensors laid end to end
(``sum(segments) = n``), so 1-bit sign keeps one scale per parameter tensor.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "WIRE_DTYPES",
    "CastCompressor",
    "Compressor",
    "ErrorFeedback",
    "Packet",
    "SignCompressor",
    "TopKCompressor",
    "build_compressor",
]

# The dtype a gossip message travels in for each `gossip.compress` that only casts.
WIRE_DTYPES = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


@dataclass
class Packet:
    """What goes on the wire for one compressed vector."""

    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def to_bytes(self) -> torch.Tensor:
        """One uint8 tensor (one message per peer and round on the wire)."""
        return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in self.tensors])

    def like(self, buffer: torch.Tensor) -> Packet:
        """The packet shaped like this one whose bytes are ``buffer`` (copies: aligned views)."""
        out, start = [], 0
        for t in self.tensors:
            size = t.numel() * t.element_size()
            out.append(buffer[start : start + size].clone().view(t.dtype))
            start += size
        return Packet(out)


class Compressor(ABC):
    """Encode a flat fp32 vector into a `Packet` of fixed shapes, and decode one."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Packet:
        """The packet for ``x``."""

    @abstractmethod
    def decode(self, packet: Packet) -> torch.Tensor:
        """The flat fp32 vector ``packet`` stands for."""


class TopKCompressor(Compressor):
    """The ``k = ceil(ratio * n)`` entries of largest magnitude: fp32 values, int32 indices."""

    def __init__(self, n: int, ratio: float) -> None:
        self.n, self.k = n, max(1, min(n, math.ceil(ratio * n)))

    def encode(self, x: torch.Tensor) -> Packet:
        indices = x.abs().topk(self.k, sorted=False).indices
        return Packet([x[indices].float(), indices.to(torch.int32)])

    def decode(self, packet: Packet) -> torch.Tensor:
        values, indices = packet.tensors
        out = torch.zeros(self.n, dtype=values.dtype, device=values.device)
        out[indices.long()] = values
        return out


class SignCompressor(Compressor):
    """1-bit SGD: the signs packed 8 to a byte, and per segment the mean magnitude."""

    def __init__(self, segments: Sequence[int]) -> None:
        self.segments = [int(s) for s in segments]
        self.n = sum(self.segments)
        self.index = torch.repeat_interleave(
            torch.arange(len(self.segments)), torch.tensor(self.segments)
        )

    def encode(self, x: torch.Tensor) -> Packet:
        x = x.float()
        index = self.index.to(x.device)
        sums = x.new_zeros(len(self.segments)).index_add_(0, index, x.abs())
        scales = sums / torch.tensor(self.segments, dtype=torch.float32, device=x.device)
        bits = (x >= 0).to(torch.uint8)
        bits = torch.cat([bits, bits.new_zeros((-self.n) % 8)]).view(-1, 8)
        packed = (bits << _SHIFTS.to(x.device)).sum(dim=1, dtype=torch.uint8)
        return Packet([packed, scales])

    def decode(self, packet: Packet) -> torch.Tensor:
        packed, scales = packet.tensors
        bits = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1
        signs = bits.reshape(-1)[: self.n].float() * 2 - 1
        return signs * scales[self.index.to(scales.device)]


class CastCompressor(Compressor):
    """fp16 / bf16: every value rounded to ``dtype`` (summable on the wire: an all-reduce)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def encode(self, x: torch.Tensor) -> Packet:
        return Packet([x.to(self.dtype)])

    def decode(self, packet: Packet) -> torch.Tensor:
        return packet.tensors[0].float()


def build_compressor(name: str, segments: Sequence[int], topk_ratio: float) -> Compressor:
    """The compressor ``gossip.compress`` names (not ``none``)."""
    if name == "topk":
        return TopKCompressor(sum(segments), topk_ratio)
    if name == "sign":
        return SignCompressor(segments)
    if name in ("fp16", "bf16"):
        return CastCompressor(torch.float16 if name == "fp16" else torch.bfloat16)
    raise ValueError(f"unknown compressor {name!r}")


class ErrorFeedback:
    """A compressor that carries what it left out into the next message ([Note: error
    feedback])."""

    def __init__(self, compressor: Compressor, n: int, device: torch.device | None = None) -> None:
        self.compressor = compressor
        self.residual = torch.zeros(n, device=device)

    def compress(self, x: torch.Tensor) -> tuple[Packet, torch.Tensor]:
        """The packet for ``x + residual`` and its decoded value (what receivers will see)."""
        corrected = x.float() + self.residual
        packet = self.compressor.encode(corrected)
        sent = self.compressor.decode(packet)
        self.residual = corrected - sent
        return packet, sent
