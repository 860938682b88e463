"""Tensor point-to-point messages with a shape and dtype handshake (pipeline activations, gradients).

The wire carries tensors only (no pickle). The first message on a *channel* -- a (peer, name)
pair chosen by the caller, e.g. ``(next_rank, "act")`` -- is preceded by a fixed-size int64
header ``[ndim, dtype_code, d0, d1, ...]``; both ends cache the shape and dtype and every later
message on that channel is the bare payload. Sends are non-blocking (``isend``); the caller keeps
the returned `PendingSends` alive until they complete (see [Note: runtime assumption] in
`polytrain.pipeline.schedule.lowering`). Messages between two ranks match in the order they were
posted, so receivers must receive in the sender's order.

[Note: channel shapes] A channel's shape is fixed by its first message; sending a tensor of
another shape on it is a `ProtocolError` on the sender (the receiver could not know). Callers use
distinct channel names for traffic of different shapes (training micro-batches vs evaluation
batches) -- and distinct process groups for traffic that may interleave out of order.

[Note: one connection per direction] A channel may have its own process group
(``channel_groups``), i.e. its own gloo TCP connection. A pipeline sends activations one way and
gradients the other, and in 1F1B's steady state both neighbours send at the same moment. On one
shared connection a gloo send of a large tensor whose receive is already posted is written
inline while the sender holds that connection's lock, so two simultaneous sends on one pair
stall each other and the receiver's reads: measured on 2 stages of gpt-tiny (131 kB messages),
sends of 3-5 ms instead of 0.1-0.2 ms and 5 ms more receive wait per step, 0.93x the throughput
of torch's Schedule1F1B. With activations and gradients on two groups the stall is gone
(1.01-1.02x; benchmarks/pipeline/README.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from polytrain.comm.init import new_group
from polytrain.errors import ProtocolError

__all__ = [
    "MAX_NDIM",
    "P2P",
    "PendingSends",
    "Work",
    "new_group_of",
    "new_group_or_none",
    "recv_into",
    "send_all",
]

MAX_NDIM = 6
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_HEADER_LEN = 2 + MAX_NDIM

Work = dist.Work
"""Handle of a posted send or receive (``wait()``, ``is_completed()``)."""


@dataclass
class PendingSends:
    """Works of non-blocking sends and the tensors they read (kept alive until done)."""

    works: list[dist.Work] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)

    def add(self, work: dist.Work | None, tensor: torch.Tensor) -> None:
        if work is not None:
            self.works.append(work)
            self.buffers.append(tensor)

    def wait(self) -> None:
        """Block until every send has completed, then drop the buffers."""
        for work in self.works:
            work.wait()
        self.works.clear()
        self.buffers.clear()

    def wait_first(self, count: int) -> None:
        """Block until the first ``count`` sends have completed; keep the later ones."""
        for work in self.works[:count]:
            work.wait()
        del self.works[:count], self.buffers[:count]

    def __len__(self) -> int:
        return len(self.works)


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > MAX_NDIM or tensor.dtype not in _CODE:
        raise ProtocolError(
            f"cannot send a tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype}: "
            f"expected at most {MAX_NDIM} dims and one of {', '.join(map(str, _DTYPES))}"
        )
    values = [tensor.dim(), _CODE[tensor.dtype], *tensor.shape]
    values += [0] * (_HEADER_LEN - len(values))
    return torch.tensor(values, dtype=torch.int64)


def _parse_header(header: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    ndim, code = int(header[0]), int(header[1])
    if not 0 <= ndim <= MAX_NDIM or not 0 <= code < len(_DTYPES):
        raise ProtocolError(f"malformed tensor header {header.tolist()}: ndim or dtype code")
    return torch.Size(int(d) for d in header[2 : 2 + ndim]), _DTYPES[code]


class P2P:
    """Point-to-point tensor channels over process groups; peers are global ranks.

    Every channel uses ``group`` unless ``channel_groups`` names another group for its name
    ([Note: one connection per direction]).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        *,
        channel_groups: Mapping[str, dist.ProcessGroup] | None = None,
    ) -> None:
        self.group = group
        self.channel_groups = dict(channel_groups or {})
        self.device = device
        self._sent: dict[tuple[int, str], tuple[torch.Size, torch.dtype]] = {}
        self._received: dict[tuple[int, str], tuple[torch.Size, torch.dtype]] = {}

    def isend(self, tensor: torch.Tensor, dst: int, channel: str, pending: PendingSends) -> None:
        """Post a non-blocking send of ``tensor`` to global rank ``dst``; works go to ``pending``."""
        tensor = tensor.detach().contiguous()
        group = self._group(channel)
        key = (dst, channel)
        meta = (tensor.shape, tensor.dtype)
        known = self._sent.get(key)
        if known is None:
            header = _header(tensor).to(self.device)
            pending.add(dist.isend(header, dst=dst, group=group), header)
            self._sent[key] = meta
        elif known != meta:
            raise ProtocolError(
                f"channel {channel!r} to rank {dst} carries {tuple(known[0])} {known[1]} but got "
                f"{tuple(tensor.shape)} {tensor.dtype}: use another channel name for this shape"
            )
        pending.add(dist.isend(tensor, dst=dst, group=group), tensor)

    def _group(self, channel: str) -> dist.ProcessGroup | None:
        return self.channel_groups.get(channel, self.group)

    def knows(self, src: int, channel: str) -> bool:
        """True once ``(src, channel)``'s header has arrived: `irecv` on it will not block."""
        return (src, channel) in self._received

    def irecv(self, src: int, channel: str) -> tuple[torch.Tensor, dist.Work | None]:
        """Post a receive from global rank ``src``; the first one on a channel reads the header."""
        key = (src, channel)
        group = self._group(channel)
        meta = self._received.get(key)
        if meta is None:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            dist.recv(header, src=src, group=group)
            meta = _parse_header(header.cpu())
            self._received[key] = meta
        buffer = torch.empty(meta[0], dtype=meta[1], device=self.device)
        return buffer, dist.irecv(buffer, src=src, group=group)

    def recv(self, src: int, channel: str) -> torch.Tensor:
        """Blocking receive of the next message on ``(src, channel)``."""
        buffer, work = self.irecv(src, channel)
        if work is not None:
            work.wait()
        return buffer


def send_all(
    tensors: Sequence[torch.Tensor], dst: int, group: dist.ProcessGroup | None = None
) -> None:
    """Send ``tensors`` to ``dst`` in order, batched; the receiver knows their shapes."""
    ops = [dist.P2POp(dist.isend, t.detach().contiguous(), dst, group) for t in tensors]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def recv_into(
    buffers: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup | None = None
) -> None:
    """Receive into ``buffers`` (shapes known on both ends) from ``src``, in order, batched."""
    ops = [dist.P2POp(dist.irecv, b, src, group) for b in buffers]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def new_group_of(groups: Sequence[Sequence[int]], rank: int) -> dist.ProcessGroup:
    """Create a fresh process group for every rank list of ``groups``; return ``rank``'s.

    Collective over the default group: every rank must call it with the same ``groups``. A
    fresh group is a private channel: messages left in flight on another group (a PipeDream
    stream between steps) can never be matched by a receive posted on this one.
    """
    mine = new_group_or_none(groups, rank)
    assert mine is not None, f"rank {rank} is in none of the groups {groups}"
    return mine


def new_group_or_none(groups: Sequence[Sequence[int]], rank: int) -> dist.ProcessGroup | None:
    """`new_group_of` for groups that leave some ranks out: those get None."""
    mine: dist.ProcessGroup | None = None
    for ranks in groups:
        group = new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
