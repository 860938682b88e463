"""The wire of sufficient-factor exchange: gather every rank's factor rows, count the bytes.

Xie et al., "Distributed Machine Learning via Sufficient Factor Broadcasting" (2015/2018): a
linear layer's weight gradient over a batch is ``G^T X``, a sum of rank-one terms; ranks send
the factors ``X`` (N x n) and ``G`` (N x m) instead of the m x n product. Here one
``all_gather_single`` per layer carries both, packed side by side as an (N, n + m) block,
and it runs asynchronously so the gather overlaps the rest of backward.

Bytes are counted per rank as the ring algorithm moves them: an all-gather of ``w`` blocks of
``b`` bytes sends ``(w - 1) b`` from every rank; an all-reduce of ``b`` bytes sends
``2 (w - 1) / w * b``. The same formulas feed the per-layer chooser, so the measured and the
modelled bytes agree by construction; what gloo or NCCL actually put on the wire depends on
their algorithm (NCCL rings match; gloo's all-gather is a ring too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "PendingGather",
    "Traffic",
    "all_gather_bytes",
    "all_gather_rows_async",
    "ring_all_reduce_bytes",
    "traffic",
]


@dataclass
class Traffic:
    """Bytes this process sent through sufficient-factor gathers (reset by the caller)."""

    bytes_sent: int = 0
    gathers: int = 0

    def reset(self) -> None:
        self.bytes_sent = 0
        self.gathers = 0


traffic = Traffic()


def ring_all_reduce_bytes(num_bytes: int, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``num_bytes``: reduce-scatter + all-gather."""
    return 2.0 * (world_size - 1) / world_size * num_bytes


def all_gather_bytes(block_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather of one ``block_bytes`` block per rank."""
    return (world_size - 1) * block_bytes


class PendingGather:
    """An all-gather in flight; `wait` returns the (world * N, k) rows in rank order."""

    def __init__(self, out: torch.Tensor, work: dist.Work | None) -> None:
        self._out, self._work = out, work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._out


def all_gather_rows_async(rows: torch.Tensor, group: dist.ProcessGroup) -> PendingGather:
    """Start gathering ``rows`` (N, k) from every rank of ``group`` into (world * N, k)."""
    rows = rows.contiguous()
    world = dist.get_world_size(group)
    out = rows.new_empty((world * rows.size(0), *rows.shape[1:]))
    if world == 1:
        out.copy_(rows)
        return PendingGather(out, None)
    work = dist.all_gather_single(out, rows, group=group, async_op=True)
    traffic.bytes_sent += all_gather_bytes(rows.numel() * rows.element_size(), world)
    traffic.gathers += 1
    return PendingGather(out, work)
